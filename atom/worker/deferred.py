"""Sampled tokens whose copy to the host is still in flight (async scheduling).

With async scheduling the engine plans step N+1 while step N runs, and N+1's
decode rows carry a placeholder for the token N samples. If the runner waited
for N's tokens before returning, the GPU would sit idle from the end of N
until the runner had filled in N+1's inputs and launched it. Instead, a
step on the CUDA graphs whose rows sample without penalties or logprobs
(greedy or random: the sampler runs on the device) returns at once with its
tokens still on the device: the copy to the host is queued behind them, and
the next step takes its placeholders from the device tensor
(``DeferredTokens.patch``), so it is queued right behind N.

Whoever needs the tokens on the host first calls ``resolve()``: the engine's
update of step N, or the runner before a step that must read them there
(sampling with penalties or logprobs, the eager path). It waits for the copy,
appends each row's tokens to the runner's per-request history, and fills the
step's ``RunnerOutput``. It runs once (under a lock: the engine's thread and the
runner's may both ask).

With speculation, a verification step on the graphs whose drafting runs right
behind it returns the same way (``DeferredVerification``): the next step's rows,
planned before the accepted counts were known, are filled in on the device from
its outcome.
"""

from __future__ import annotations

import threading

import torch

from atom.engine.scheduler_output import RunnerOutput


class HostCopy:
    """int64 ids copied into ``host`` (pinned, on a GPU) without waiting; ``wait()`` returns them as a
    list. On a GPU the wait is an event's, which lets other Python threads run meanwhile."""

    def __init__(self, ids: torch.Tensor, host: torch.Tensor) -> None:
        on_gpu = ids.device.type == "cuda"
        self._host = host[: ids.numel()]
        self._host.copy_(ids.flatten(), non_blocking=on_gpu)
        self._done = None
        if on_gpu:
            self._done = torch.cuda.Event()
            self._done.record()

    def wait(self) -> list[int]:
        if self._done is not None:
            self._done.synchronize()  # waits without the GIL
        return self._host.tolist()


class Deferred:
    """One runner step's outcome (an int64 device tensor) on its way to the host, for the rows of
    ``request_ids``. ``resolve()`` waits for the copy and hands the values to ``_apply``; it runs once,
    under a lock (the engine's thread and the runner's may both ask)."""

    def __init__(self, on_device: torch.Tensor, request_ids: list[str], out: RunnerOutput, host: torch.Tensor) -> None:
        self.columns = {rid: i for i, rid in enumerate(request_ids)}
        self._request_ids, self._out = request_ids, out
        self._copy = HostCopy(on_device, host)
        self._lock = threading.Lock()
        self.resolved = False

    def resolve(self) -> None:
        with self._lock:
            if self.resolved:
                return
            self._apply(self._copy.wait())
            self.resolved = True

    def _apply(self, values: list[int]) -> None:
        raise NotImplementedError


class DeferredTokens(Deferred):
    """Tokens [k, n] (k steps of n rows, step-major) of one runner step, on their way to the host.
    ``resolve()`` appends each row's tokens to its history and to the step's output.

    ``tokens`` may be a view into a decode graph's output buffer (a greedy step's argmax), which that
    graph's next replay overwrites: only work queued on the stream before it may read them, as the
    copy to the host and the next step's patch are."""

    def __init__(self, tokens: torch.Tensor, request_ids: list[str], histories: list[list[int]],
                 out: RunnerOutput, host: torch.Tensor) -> None:  # fmt: skip
        super().__init__(tokens, request_ids, out, host)
        self.tokens = tokens
        self._histories = histories

    def _apply(self, values: list[int]) -> None:
        n = len(self._request_ids)
        for i, (rid, history) in enumerate(zip(self._request_ids, self._histories)):
            row = values[i::n]
            history.extend(row)
            self._out.sampled[rid] = row


class DeferredVerification(Deferred):
    """A verification step's outcome on its way to the host (speculation with overlap, on the graphs): per row
    its targets [n, w] (its accepted drafts, then the token it emits after them), its accepted count [n] and
    the drafts proposed after it [k, n], in one int64 tensor whose copy to the host is queued behind them.

    The next step's rows planned while this one ran read their inputs, starts and state slots from it on the
    device (``atom.ops.cuda.fused.settle_verification``). ``resolve()`` gives each row its tokens (in the
    step's output and the runner's history) and what a row planned after it needs on the host
    (``num_rejected``, ``next_drafts``: ``model_runner.CachedRequestState``)."""

    def __init__(self, packed: torch.Tensor, width: int, request_ids: list[str], states: list, planned: list[int],
                 out: RunnerOutput, host: torch.Tensor) -> None:  # fmt: skip
        super().__init__(packed, request_ids, out, host)
        self.n, self.width = len(request_ids), width
        self.packed = packed  # (atom.ops.cuda.fused.pack_verification)
        self.planned = planned  # each row's drafts as planned (placeholders included)
        self._states = states

    def _apply(self, values: list[int]) -> None:
        n, w = self.n, self.width
        accepted, drafts = values[n * w : n * (w + 1)], values[n * (w + 1) :]
        for i, (rid, st) in enumerate(zip(self._request_ids, self._states)):
            tokens = values[i * w : i * w + accepted[i] + 1]
            st.output_token_ids.extend(tokens)
            st.num_rejected = self.planned[i] - accepted[i]
            st.next_drafts = drafts[i::n]
            self._out.sampled[rid] = tokens
            self._out.draft_token_ids[rid] = st.next_drafts


class PinnedRing:
    """A few pinned host buffers used in turn for copies to the host. A buffer lent to a deferred
    step is taken again only once that step has been resolved (resolving it first if need be)."""

    def __init__(self, size: int = 4) -> None:
        self._buffers: list[torch.Tensor | None] = [None] * size
        self._users: list[Deferred | None] = [None] * size
        self._next = 0

    def take(self, numel: int, pin: bool) -> tuple[int, torch.Tensor]:
        i = self._next
        self._next = (i + 1) % len(self._buffers)
        user = self._users[i]
        if user is not None and not user.resolved:
            user.resolve()
        buf = self._buffers[i]
        if buf is None or buf.numel() < numel:
            buf = torch.empty(max(numel, 256), dtype=torch.int64, pin_memory=pin)
            self._buffers[i] = buf
        return i, buf

    def lend(self, i: int, user: Deferred) -> None:
        self._users[i] = user
