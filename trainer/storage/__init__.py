"""The one storage layer: every layout the service keeps beside its registry (runs' checkpoints and
exports, Tinker checkpoints and records), on a local folder or S3-compatible object storage, and
whole-or-nothing folders. It lives under trainer/ (not service/, as DESIGN.md sketched) because the
trainer ranks write through it (checkpoints, slot states, PEFT exports) and trainer/ imports neither
service/ nor rollout/. Spill files and weight hand-off folders stay node-local files (layouts.py).

May import: nothing of the product.
"""
