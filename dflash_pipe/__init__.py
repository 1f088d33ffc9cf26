"""dflash-pipe: extract target features once, train DFlash drafters many times."""

__version__ = "0.1.0"
