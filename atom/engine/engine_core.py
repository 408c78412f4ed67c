"""One rank's engine: validate requests, schedule, run a step, turn results into outputs.

``step()`` is schedule -> execute -> update. The front ends (``LLM`` and
``AsyncEngine``) drive it; ``AsyncEngine`` runs ``execute`` in a worker
thread so the event loop stays free while a forward runs.
"""

from __future__ import annotations

import logging
import os
import sys
import time

from atom.config import EngineConfig
from atom.engine.detokenizer import Detokenizer
from atom.engine.kv_cache_manager import KVCacheManager
from atom.engine.request import Request, RequestStatus
from atom.engine.scheduler import Scheduler
from atom.engine.scheduler_output import RunnerOutput, SchedulerOutput
from atom.outputs import CompletionOutput, RequestOutput
from atom.sampling_params import SamplingParams
from atom.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def load_tokenizer(path: str):
    """The checkpoint's tokenizer, or None when the folder has no tokenizer files."""
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any(os.path.exists(os.path.join(path, n)) for n in names):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


# With the forward on its own thread, that thread needs the GIL for a moment to launch
# each step, while the scheduling thread runs pure Python. CPython hands the GIL over
# only every switch interval (5 ms by default: longer than a whole decode step on a GPU).
FORWARD_THREAD_SWITCH_INTERVAL_S = 0.0002


def shorten_gil_switch_interval() -> None:
    """Let a forward thread get the GIL within ~0.2 ms (process-wide; only ever shortened)."""
    if sys.getswitchinterval() > FORWARD_THREAD_SWITCH_INTERVAL_S:
        sys.setswitchinterval(FORWARD_THREAD_SWITCH_INTERVAL_S)


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.tokenizer = load_tokenizer(config.tokenizer or config.model)
        self.runner = ModelRunner(config)
        # False: update() reports finished requests only (the offline LLM, which streams nothing)
        self.stream_outputs = True
        prefix_caching = config.enable_prefix_caching
        if prefix_caching and self.runner.has_recurrent_state:
            logger.info(
                "prefix caching is off for %s: its recurrent (KDA) state is not checkpointed at block "
                "boundaries, so a cached prefix could not resume from a real state",
                config.architecture,
            )
            prefix_caching = False
        self.kv = KVCacheManager(
            num_blocks=self.runner.layout.num_blocks,
            block_size=config.block_size,
            num_state_groups=self.runner.layout.num_state_groups,
            slots_per_group=config.slots_per_request,
            enable_prefix_caching=prefix_caching,
        )
        self.scheduler = Scheduler(config, self.kv)
        self.detokenizer = Detokenizer(self.tokenizer)
        self.scheduler.text_stop = self._text_stop
        self.connector_worker = None  # P/D worker half; started by AsyncEngine on its loop
        # P/D: the last plan was made while a step ran, so its remote loads wait for that step's update:
        # blocks the plan freed (a preemption, an abort) may still be written by that step.
        self.loads_wait_for_step = False
        if config.kv_transfer_config is not None:
            self._make_connector(config.kv_transfer_config)
        self._counter = 0

    def _make_connector(self, kv_config) -> None:
        from atom.kv_transfer.factory import make_connector
        from atom.layers.cache_spec import RecurrentStateSpec

        kinds = {layer: "slot" if isinstance(spec, RecurrentStateSpec) else "block"
                 for layer, spec in self.runner.cache_specs.items()}
        self.scheduler.connector, self.connector_worker = make_connector(
            kv_config, block_size=self.config.block_size, caches=self.runner.caches, cache_kinds=kinds)
        if self.connector_worker.uses_host_buffer:
            need = self.connector_worker.packed_bytes(self.config.max_model_len)
            if kv_config.kv_buffer_size is None:
                self.connector_worker.host_buffer_size = max(self.connector_worker.host_buffer_size, need)
            elif need > kv_config.kv_buffer_size:
                raise ValueError(
                    f"kv_transfer_config: kv_buffer_size={kv_config.kv_buffer_size} bytes cannot hold one "
                    f"{self.config.max_model_len}-token request's KV and state ({need} bytes); raise "
                    f"kv_buffer_size to at least {need} (or leave it out), or lower max_model_len")

    # -- requests --------------------------------------------------------------
    def make_request(
        self, prompt: str | dict | list[int], params: SamplingParams, request_id: str | None = None,
        kv_transfer_params: dict | None = None,
    ) -> Request:
        """Validate a prompt and its params; raise ValueError naming the fix."""
        text, token_ids = self._tokenize(prompt)
        if not token_ids:
            raise ValueError("the prompt is empty; pass at least one token")
        limit = self.config.max_model_len
        if len(token_ids) >= limit:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens but max_model_len is {limit}; shorten the prompt "
                f"or raise max_model_len (it must leave room for at least one output token)"
            )
        vocab = self.config.hf_config.get("vocab_size")
        if vocab is not None and any(t < 0 or t >= vocab for t in token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab}); got an id outside it")
        if request_id is None:
            request_id = f"req-{self._counter}"
            self._counter += 1
        request = Request(request_id, token_ids, params, self.config.eos_token_ids, prompt=text)
        if kv_transfer_params is not None:
            if self.scheduler.connector is None:
                raise ValueError("kv_transfer_params given, but this engine has no --kv-transfer-config")
            request.kv_transfer_params = dict(kv_transfer_params)
            self.scheduler.connector.num_remote_tokens(request)  # validates a consumer's params
            handed = [kv_transfer_params.get("first_token", 0), *(kv_transfer_params.get("draft_token_ids") or [])]
            if vocab is not None and any(t >= vocab for t in handed):  # (their types: checked just above)
                raise ValueError(f"kv_transfer_params name a token id outside [0, {vocab}); pass the "
                                 "kv_transfer_params the prefill engine returned, unchanged, to a decode engine of "
                                 "the same model")
        return request

    def _tokenize(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
            prompt = prompt.get("prompt")
        if isinstance(prompt, (list, tuple)):
            return None, [int(t) for t in prompt]
        if not isinstance(prompt, str):
            raise ValueError("a prompt is a string, a list of token ids or {'prompt_token_ids': [...]}")
        if self.tokenizer is None:
            raise ValueError(
                f"{self.config.model!r} has no tokenizer files; pass {{'prompt_token_ids': [...]}} instead of text"
            )
        return prompt, self.tokenizer.encode(prompt)

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        request = self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        if request is None:
            return None
        self.start_connector_work()  # e.g. a cancelled load
        self.detokenizer.flush(request)
        return self._make_output(request)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def poll_connector(self) -> list[RequestOutput]:
        """P/D: apply what the connector's worker half finished (loads, releases)."""
        if self.connector_worker is None:
            return []
        changed = self.scheduler.apply_connector_output(self.connector_worker.take_output())
        self.start_connector_work()
        return self._outputs_for(changed)

    def start_connector_work(self) -> None:
        if self.connector_worker is not None:
            self.connector_worker.handle(self.scheduler.connector.build_metadata(self.loads_wait_for_step))

    # -- the step ----------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        return self.scheduler.schedule()

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        return self.runner.execute_model(sched)

    def update(self, sched: SchedulerOutput, result: RunnerOutput) -> list[RequestOutput]:
        if result.wait is not None:  # its tokens were still being copied to the host
            result.wait()
        changed = self.scheduler.update(sched, result)
        # Hand new producer holds to the worker half before anyone can see their params:
        # a consumer may pull as soon as the output reaches the client. Loads planned beside
        # this step go out now too: it has ended.
        self.loads_wait_for_step = False
        self.start_connector_work()
        return self._outputs_for(changed)

    def _outputs_for(self, changed: list[Request]) -> list[RequestOutput]:
        outputs = []
        for request in changed:
            if request.first_token_time is None:
                request.first_token_time = time.monotonic()
            if request.is_finished:
                self.detokenizer.flush(request)
            elif not self.stream_outputs:
                continue
            outputs.append(self._make_output(request))
        return outputs

    def _text_stop(self, request: Request) -> str | None:
        """Detokenize the newest token; the stop string it completed, if any."""
        return self.detokenizer.update(request)

    def step(self) -> list[RequestOutput]:
        sched = self.schedule()
        result = self.execute(sched)
        return self.update(sched, result)

    def _make_output(self, request: Request) -> RequestOutput:
        params = request.sampling_params
        new_ids = request.output_token_ids[request.num_sent_tokens :]
        # Hold back text that could still turn out to be the start of a stop string:
        # once streamed, it could not be taken back.
        visible = len(request.output_text)
        if params.stop and not request.is_finished:
            visible -= max(len(s) for s in params.stop) - 1
        visible = max(visible, request.num_sent_chars)
        new_text = request.output_text[request.num_sent_chars : visible]
        request.num_sent_tokens = request.num_output_tokens
        request.num_sent_chars = visible
        completion = CompletionOutput(
            index=0,
            text=request.output_text,
            token_ids=list(request.output_token_ids),
            logprobs=list(request.logprobs) if params.logprobs is not None else None,
            finish_reason=request.status.finish_reason,
            stop_reason=request.stop_reason,
        )
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[completion],
            finished=request.is_finished,
            prompt_logprobs=list(request.prompt_logprobs) if request.wants_prompt_logprobs else None,
            num_cached_tokens=request.num_cached_tokens,
            new_token_ids=new_ids,
            new_text=new_text,
            metrics=self._request_metrics(request),
            kv_transfer_params=request.kv_transfer_params_out,
            error=request.error,
        )

    @staticmethod
    def _request_metrics(request: Request) -> dict[str, float]:
        now = time.monotonic()
        m = {"arrival_time": request.arrival_time, "e2e": now - request.arrival_time,
             "num_draft_tokens": request.num_draft_tokens, "num_accepted_tokens": request.num_accepted_tokens,
             "num_verify_steps": request.num_verify_steps}
        if request.first_token_time is not None:
            m["ttft"] = request.first_token_time - request.arrival_time
        return m

    def all_resources_free(self) -> bool:
        """Every KV block and state slot free, and no region of a P/D host buffer lent."""
        worker = self.connector_worker
        return self.kv.all_free() and (worker is None or worker.host_buffer_bytes_lent == 0)
