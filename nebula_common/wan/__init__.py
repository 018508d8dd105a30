"""WAN link emulation, so the split-training path can be exercised without a real slow link."""

from nebula_common.wan.emulator import LinkShape, WanEmulator

__all__ = ["LinkShape", "WanEmulator"]
