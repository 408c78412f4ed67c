"""Per-request sampling parameters, shaped like vLLM's ``SamplingParams``.

Validated at construction: a bad value raises ``ValueError`` naming the fix,
so a user's mistake never reaches the sampler.
"""

from __future__ import annotations

from dataclasses import dataclass

# A request samples greedily below this temperature: all such a distribution keeps of the logits is their argmax
# (vLLM's threshold too). Far below it, logits / temperature overflow in fp32 and the probabilities become NaN.
GREEDY_BELOW_TEMPERATURE = 1e-5
# Parameters reach the sampler as float32: a temperature past its range becomes inf (and inf / inf = NaN), and a
# repetition penalty far from 1 turns logits into inf or 0 (1e-300 becomes 0, and logits / 0 = inf).
MAX_TEMPERATURE = 3.4028234663852886e38  # float32's largest finite value
REPETITION_PENALTY_RANGE = (1e-6, 1e6)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: list[str] | str | None = None  # normalised to a list
    stop_token_ids: list[int] | None = None  # normalised to a list
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n logprobs of each sampled token
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    detokenize: bool = True

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._validate_sampling()
        self._validate_lengths()

    def _validate_sampling(self) -> None:
        if self.n != 1:
            raise ValueError(f"n={self.n} is not supported; ATOM returns one sequence per request, use n=1")
        if not 0 <= self.temperature <= MAX_TEMPERATURE:  # NaN and inf too
            raise ValueError(f"temperature={self.temperature} must be a finite number >= 0 (0 means greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]; use 1 to disable")
        if self.top_k < -1:
            raise ValueError(f"top_k={self.top_k} must be >= 1, or 0 / -1 to disable")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p={self.min_p} must be in [0, 1]; use 0 to disable")
        if not -2 <= self.presence_penalty <= 2:
            raise ValueError(f"presence_penalty={self.presence_penalty} must be in [-2, 2]")
        if not -2 <= self.frequency_penalty <= 2:
            raise ValueError(f"frequency_penalty={self.frequency_penalty} must be in [-2, 2]")
        low, high = REPETITION_PENALTY_RANGE
        if not low <= self.repetition_penalty <= high:  # NaN too
            raise ValueError(f"repetition_penalty={self.repetition_penalty} must be in [{low:g}, {high:g}]; "
                             "use 1 to disable")
        if self.seed is not None and not (isinstance(self.seed, int) and -(2**63) <= self.seed < 2**63):
            # a 64-bit seed (a request keys its draws by it: atom.ops.sampling.seed_state)
            raise ValueError(f"seed={self.seed} must be an integer in [-2**63, 2**63 - 1], or None for no seed")

    def _validate_lengths(self) -> None:
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} must be >= 1, or None for up to max_model_len")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens={self.min_tokens} must be >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} must be <= max_tokens={self.max_tokens}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs={self.logprobs} must be >= 0, or None to disable")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise ValueError(f"prompt_logprobs={self.prompt_logprobs} must be >= 0, or None to disable")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE or self.top_k == 1

    @property
    def filters_top_k_top_p(self) -> bool:
        """Whether sampling keeps only the top-k tokens or the top-p nucleus (a sort of the vocabulary)."""
        return self.top_k > 0 or self.top_p < 1

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1
