"""Offline, synchronous API shaped like vLLM's ``LLM``: switch by changing an import."""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any, Sequence

from tqdm import tqdm

from atom.config import EngineConfig, SpeculativeConfig
from atom.engine.engine_core import EngineCore, shorten_gil_switch_interval
from atom.outputs import RequestOutput
from atom.sampling_params import SamplingParams

PromptType = str | dict[str, Any] | list[int]


class LLM:
    def __init__(self, model: str, **kwargs: Any) -> None:
        spec = kwargs.pop("speculative_config", None)
        if isinstance(spec, dict):
            spec = SpeculativeConfig.from_dict(spec)
        self.config = EngineConfig(model=model, speculative_config=spec, **kwargs)
        if self.config.kv_transfer_config is not None:
            raise ValueError("kv_transfer_config (P/D) needs the event-loop engine: use AsyncEngine or "
                             "`atom-engine serve --kv-transfer-config ...`, not LLM")
        self.engine = EngineCore(self.config)
        self.engine.stream_outputs = False  # generate() returns finished requests only
        self._next_id = 0
        # async_scheduling: the thread that runs the forward passes, started by the first generate() and kept
        # for the next ones (a fresh thread for each call cost tens of ms a call on the H200)
        self._forward_thread: ThreadPoolExecutor | None = None

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run prompts to completion; outputs come back in prompt order.

        Every prompt is validated before any is queued, so a bad one raises
        ValueError and leaves the engine exactly as it was.
        """
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        params = self._params_list(sampling_params, len(prompts))
        requests = []
        for prompt, p in zip(prompts, params):
            requests.append(self.engine.make_request(prompt, p, request_id=str(self._next_id + len(requests))))
        self._next_id += len(requests)
        for request in requests:
            self.engine.add_request(request)
        return self._run(requests, use_tqdm and sys.stderr.isatty() and len(requests) > 1)

    @staticmethod
    def _params_list(sampling_params, n: int) -> list[SamplingParams]:
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        params = list(sampling_params)
        if len(params) != n:
            raise ValueError(f"got {n} prompts but {len(params)} sampling params; pass one or one per prompt")
        return params

    def _steps(self):
        """Step outputs until no request is left; with async_scheduling, step N+1 is
        planned and queued on the forward thread before step N's results are applied."""
        core = self.engine
        if not self.config.async_scheduling:
            while core.has_unfinished_requests():
                yield core.step()
            return
        if str(self.config.device).startswith("cuda"):  # a GPU step is shorter than the default 5 ms
            shorten_gil_switch_interval()
        if self._forward_thread is None:
            self._forward_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="atom-forward")
        inflight = nxt = None
        try:
            while inflight is not None or core.has_unfinished_requests():
                nxt = None
                if core.has_unfinished_requests():
                    sched = core.schedule()
                    nxt = (sched, self._forward_thread.submit(core.execute, sched))
                if inflight is not None:
                    yield core.update(inflight[0], inflight[1].result())
                inflight = nxt
        finally:  # an error or an interrupt: the steps queued end before anyone goes on
            wait([step[1] for step in (inflight, nxt) if step is not None])

    def _run(self, requests, show_progress: bool) -> list[RequestOutput]:
        final: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(requests), desc="Processed prompts", disable=not show_progress)
        try:
            for outputs in self._steps():
                for out in outputs:
                    if out.finished:
                        final[out.request_id] = out
                        bar.update(1)
        except BaseException:
            for request in requests:  # leave the engine usable after an interrupt
                self.engine.abort_request(request.request_id)
            raise
        finally:
            bar.close()
        return [final[r.request_id] for r in requests]
