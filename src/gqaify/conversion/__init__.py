"""Streaming conversion of a checkpoint's K/V heads; the entry point is `gqaify.convert` (`core.convert`).

options.py    what can be asked (methods, groupings, calibration settings), as data
source.py     SRC -> a folder of config and side files plus a tensor reader
checkpoint.py lazy tensor readers and the streaming shard writer
layout.py     one layer's head-indexed tensors <-> head-major tensors
methods.py    how a group of heads becomes one (pure functions of one layer)
fit.py        the linear algebra of the calibrated methods
grouping.py   which heads share a K/V head
calibrate.py  the statistics the calibrated methods fit on
core.py       plan, stream, commit
"""
