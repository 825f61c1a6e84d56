"""kvlab: plan, run, compress and measure the KV cache of decoder-only LLMs."""

import os as _os

# OpenMP threads that wait at a barrier sleep instead of spinning, unless the user chose (OMP_WAIT_POLICY or
# GOMP_SPINCOUNT). On busy cores a thread of a parallel region is often descheduled, and with libgomp's default
# (spin ~300,000 rounds, some milliseconds, before sleeping) the thread waiting for it spins on the very core it
# needs: every barrier then costs a scheduler time slice and decode collapses (2 threads on a loaded 2-core box:
# 0.6-1.9 tokens/s against 10-13 for 1 thread; passive: 12-15; GOMP_SPINCOUNT=1000 or 10000 only 2.5-8.5). A
# sleeping waiter costs a futex wake-up per barrier on an idle machine instead (tens of microseconds on a VM): the
# fused decode step (kernels/decode.c) and the engine's step of one row (kernels/batchstep.c) therefore cross their
# layers' barriers with one of their own that spins for tens of microseconds before it sleeps (kernels/decode.h), and
# meet OpenMP's only where their parallel region starts and ends; set
# OMP_WAIT_POLICY=active to trade the rest back. libgomp reads this once, when it is loaded (with torch): it
# takes effect when kvlab is imported before torch, as the `kvlab` command does, and in child processes.
#: True when the passive policy is kvlab's choice, not the user's (benchmarks start peers without it).
WAIT_POLICY_SET_BY_KVLAB = "OMP_WAIT_POLICY" not in _os.environ and "GOMP_SPINCOUNT" not in _os.environ
if WAIT_POLICY_SET_BY_KVLAB:
    _os.environ["OMP_WAIT_POLICY"] = "passive"

__version__ = "0.1.0"
