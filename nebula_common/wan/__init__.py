"""WAN link emulation, so the split-training path can be exercised without a real slow link."""

from nebula_common.wan.emulator import WanEmulator
from nebula_common.wan.shape import LinkShape

__all__ = ["LinkShape", "WanEmulator"]
