"""Custom rewards for the service tests, importable only because the test service lists this
module under its reward import roots."""


def always_raises(response: str, label, metadata=None) -> float:
    raise RuntimeError("reward crashed (on purpose, for the test)")
