"""The one communication layer: every byte an algorithm exchanges goes through a :class:`Comm`.

Algorithms never call ``torch.distributed`` directly. The package, one concern a module:

* :mod:`.base`: :class:`Comm`, the interface every backend implements, with its accounting
  (bytes and blocked time per operation, :class:`CommStats`; :meth:`Comm.account` for work done
  outside its own calls) and :class:`Work`, an asynchronous operation's handle.
* :mod:`.allreduce`: our own non-blocking all-reduce's algorithms over point-to-point messages
  (ring, direct exchange, recursive doubling; ``auto`` picks direct for small payloads, the ring
  for large ones, :data:`DIRECT_MAX_BYTES`) and their byte counts. :meth:`Comm.allreduce_async`
  is the template that runs them: checks, accounting and message tags in the base class, the
  exchange itself in the ``_launch`` hook (background threads here; the simulator's comm,
  ``trainers.sim.comm.SimComm``, overrides the hook alone). :meth:`Comm.allgather_async` is the
  all-gather on the same exchange and setting (direct, or ring in n-1 steps). At most
  ``max_in_flight`` (:data:`MAX_IN_FLIGHT`, ``comm.max_in_flight``) background collectives run at
  once per rank, on the real comm and the simulator's alike.
* :mod:`.streams`: :class:`MessageStreams`, the keyed fixed-size messages of a parameter-server
  exchange (``p3``, ``ps_sync``), run by the comm's :meth:`Comm.stream_driver` (whose receives
  also carry ``eawild``'s concurrent server, one service per worker connection).
* :mod:`.torch_backend`: :class:`TorchComm`, over a torch.distributed process group (gloo or nccl).
* :mod:`.tcp`: :class:`TcpComm`, the elastic comm over plain TCP that survives a peer's crash.

Measured on the emulated WAN: gloo all_reduce is round-trip bound (about 7 round trips for 10 MB
between 2 ranks), while isend/irecv moves 100 MB about 4x faster; choose per algorithm.
"""

from .allreduce import (ALLREDUCE_ALGORITHMS, BACKGROUND_TAGS, BACKGROUND_THREADS, COMBINE, DIRECT_MAX_BYTES,
                        MAX_IN_FLIGHT, AllReduceAlgorithm, ReduceOp, allgather_bytes, allreduce_bytes, tensor_nbytes)
from .base import OPS, Comm, CommStats, OpStats, PeerLost, ProcessKilled, Work, require_torchrun_env
from .streams import STREAM_TAG, MessageStreams, StreamMessage, ThreadedStreamDriver
from .tcp import TcpComm
from .torch_backend import TorchComm

__all__ = ["ALLREDUCE_ALGORITHMS", "BACKGROUND_TAGS", "BACKGROUND_THREADS", "COMBINE", "DIRECT_MAX_BYTES",
           "MAX_IN_FLIGHT", "OPS",
           "STREAM_TAG", "AllReduceAlgorithm", "Comm", "CommStats", "MessageStreams", "OpStats", "PeerLost",
           "ProcessKilled", "ReduceOp", "StreamMessage", "TcpComm", "ThreadedStreamDriver", "TorchComm", "Work",
           "allgather_bytes", "allreduce_bytes", "require_torchrun_env", "tensor_nbytes"]
