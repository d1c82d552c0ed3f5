"""An independent reference for lorafleet's trainer (tests only).

Written from the definitions, not from lorafleet's code: plain torch, Hugging Face
transformers and peft, one adapter at a time, torch's own AdamW, clip_grad_norm_ and
LambdaLR. lorafleet's mixed multi-adapter step must match it per adapter.
"""
