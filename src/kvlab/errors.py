"""One exception family. Every message is one line and names the offending input."""


class KvlabError(Exception):
    """Base class: the CLI prints `error: <message>` and exits 2, never a traceback."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))  # always a single line


class ModelFileError(KvlabError):
    """A model file that is missing, truncated, not GGUF/safetensors, or inconsistent."""


class ConfigError(KvlabError):
    """A model configuration that cannot describe a working model (e.g. n_head % n_kv_head != 0)."""


class UnsupportedArchitectureError(KvlabError):
    """An architecture the engine cannot run (the planner may still plan it)."""


class CacheCapacityError(KvlabError):
    """More tokens than a cache was allocated for."""


class NonFiniteError(KvlabError):
    """NaN or Inf reached a cache."""


class OfflineError(KvlabError):
    """A network resource was requested while offline."""


class OutputError(KvlabError):
    """A report, plot or JSON file that cannot be written where it was asked for."""


class StoreFileError(KvlabError):
    """A KV store file that is torn, truncated, of another version, or of another model or cache format."""


class InputLimitError(KvlabError):
    """A number or a text beyond what kvlab will run: too many threads, tokens past the context, an endless template."""


class RequestTooLargeError(InputLimitError):
    """A serving request that can never fit: longer than the model's context or the whole KV pool."""
