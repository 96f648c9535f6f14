"""``dapo-megatron bench``: every phase of a DAPO step measured against this machine's
ceilings (:mod:`run`), the model-FLOP formula of MFU (:mod:`flops`), the ceilings and the
published GPU peaks (:mod:`ceilings`), the console report (:mod:`report`)."""
