__version__ = "0.1.0.dev0"
__author__ = "The lightning-fsdp developers"
__license__ = "Apache-2.0"
__docs__ = "Memory-bounded, device-correct checkpoint loading for Lightning Fabric's FSDPStrategy."

#: The releases this package is tested with. Older releases are refused at import, newer ones get a warning.
_SUPPORTED_LIGHTNING = ("2.6.0", "2.7.0")
_SUPPORTED_TORCH = ("2.13.0", "2.14.0")
