"""A ring of preallocated device slots that hands step inputs (target hidden states + batch tensors) from a producer
thread to a consumer thread, synchronized with CUDA events -- no host-device sync on the hot path.

Protocol for slot k (K slots, one producer thread, one consumer thread):
  producer: k = acquire()            host: blocks only while all K slots are in flight (bounded run-ahead)
            stream.wait_event(free[k])   device: the consumer's last read of slot k is done
            ... write slot k on `stream` ...
            publish(k, stream, meta)     records ready[k] on `stream`, then hands k to the consumer
  consumer: k, meta = take()         host: blocks until the producer has *enqueued* slot k's writes
            stream.wait_event(ready[k])  (done inside take(stream))
            ... read slot k on `stream` ...
            release(k, stream)       records free[k] on `stream`, then gives k back to the producer
Host queues carry only slot indices; ordering of the data is entirely on the device (events). The host can run up to
K steps ahead of the GPU. Both sides know how many steps a run has, so a normal run needs no end marker and the ring is
reusable for the next run; `abort()` (on an error) wakes a blocked peer with `None` and leaves the ring unusable.
Thread affinity: build in the main thread; then exactly one producer and one consumer thread use it.
"""
from __future__ import annotations

import queue
from collections.abc import Mapping

import torch

_END = None


class SlotRing:
    def __init__(self, slots: int, example: Mapping[str, torch.Tensor], device: torch.device | str) -> None:
        """`example`: name -> tensor giving each field's shape and dtype; every slot gets its own buffers on `device`."""
        if slots < 2:
            raise ValueError("SlotRing needs >= 2 slots (one being written while one is read)")
        dev = torch.device(device)
        self.device = dev
        self.slots = [{k: torch.empty_like(v, device=dev) for k, v in example.items()} for _ in range(slots)]
        self.ready = [torch.cuda.Event() for _ in range(slots)]
        self.free = [torch.cuda.Event() for _ in range(slots)]
        self._free_q: queue.Queue = queue.Queue()
        self._filled_q: queue.Queue = queue.Queue()
        for k in range(slots):
            self._free_q.put(k)  # never-recorded events: waiting on them is a no-op

    def acquire(self, stream: torch.cuda.Stream) -> int | None:
        """Producer: next free slot index, with `stream` ordered after the consumer's release of it."""
        k = self._free_q.get()
        if k is _END:
            return None
        stream.wait_event(self.free[k])
        return k

    def publish(self, k: int, stream: torch.cuda.Stream, meta=None) -> None:
        self.ready[k].record(stream)
        self._filled_q.put((k, meta))

    def take(self, stream: torch.cuda.Stream):
        """Consumer: (k, slot tensors, meta) with `stream` ordered after the producer's writes; None at the end."""
        item = self._filled_q.get()
        if item is _END:
            return None
        k, meta = item
        stream.wait_event(self.ready[k])
        return k, self.slots[k], meta

    def release(self, k: int, stream: torch.cuda.Stream) -> None:
        self.free[k].record(stream)
        self._free_q.put(k)

    def abort(self) -> None:
        """Wake both sides with `None` (a thread failed). The ring must not be reused afterwards."""
        self._filled_q.put(_END)
        self._free_q.put(_END)
