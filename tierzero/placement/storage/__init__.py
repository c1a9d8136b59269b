"""Placement's storage: the bytes under the state machine. Each tier's budget and buffers, the
device's copy streams (and the CPU's asynchronous stand-in for them), this run's swap files and
their folder, and a checkpoint's files serving as NVMe homes. Nothing here knows a tensor's
residency (docs/architecture.md, "The placement's modules").
"""

# The modules, from the bytes up:
# tiers.py      Budget, HostPool, PinnedArena: a tier's byte account and host buffers
# stand_in.py   the CPU's asynchronous stand-in for the copy streams
# streams.py    the device's copy streams and events; DeviceCopies, what the runtime uses
# cow_home.py   a checkpoint's files serving as NVMe homes until first written
# swap_dirs.py  this run's locked folder; reclaiming what killed runs left
# nvme.py       this run's swap files: extents, checksummed IO through io_engine
# tier_store.py one store per tier: buffers within the tier's budget
