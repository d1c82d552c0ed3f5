"""The one storage layer: every on-disk layout (runs' checkpoints and exports, Tinker checkpoints
and records, spill files, weight hand-off folders) and whole-or-nothing folders. It lives under
trainer/ (not service/, as DESIGN.md sketched) because the trainer ranks write through it
(checkpoints, spill files, hand-off folders) and trainer/ imports neither service/ nor rollout/.

May import: nothing of the product.
"""
