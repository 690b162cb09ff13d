"""The draft-model proposer (`--speculative-method draft`): a small model with the
target's tokenizer proposes K tokens greedily, one batched forward per token.

Its KV cache is paged like the target's and shares the target's block tables: the draft's
cache has as many blocks as the target's, and block b of the draft's cache holds the
draft's K/V for the tokens whose target K/V is in block b. So the target's scheduler
allocates, frees, preempts and rolls back for both, and the draft needs no block pool
of its own (its cache is small: the built-in draft's K/V is 1/8 of the target's a token).

Its prompt's K/V is made here, on the decode worker, in the first draft forward after
the sequence starts decoding (a chunk from where the draft last computed to the last
token; later steps catch up only on the tokens verification kept). Shipping it from the
prefill worker instead would tie the prefill pool to the draft model and add a second
KV stream per request to the transfer layer, to save a forward that costs a fraction
of the target's prefill. Prefix-cache hits do not carry the draft's K/V (a hit may come
from a remote prefill that never ran the draft): the draft computes the prompt itself.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from engine.config import CacheConfig, ConfigError, DeviceConfig
from engine.plan import SampleRow, SeqWork, StepPlan
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

log = logging.getLogger(__name__)

PLACEHOLDER = 0  # a draft slot the scheduler reserves before the draft model fills it
_GREEDY = SamplingParams(temperature=0.0, max_tokens=1)


@dataclass
class _DraftState:
    computed: int = 0  # leading tokens of the sequence whose draft K/V is in the draft cache
    preemptions: int = 0


class DraftModelProposer:
    needs_blocks = True  # proposes after the scheduler allocated the draft's slots

    def __init__(self, path: str | Path, target_runner, device_config: DeviceConfig,
                 target_path: str | Path | None = None) -> None:
        from engine.models.checkpoint import load_checkpoint
        from engine.models.loader import build_model
        from engine.runner import ModelRunner

        target = target_runner.model_config
        ckpt = load_checkpoint(path, dtype=target.dtype)
        if ckpt.config.vocab_size != target.vocab_size:
            raise ConfigError(f"draft model {path}: vocab size {ckpt.config.vocab_size}, the target's is "
                              f"{target.vocab_size}; a draft needs the target's tokenizer")
        if target_path is not None:
            _check_same_tokenizer(Path(path), Path(target_path))
        model = build_model(ckpt, device_config.device)
        cache = CacheConfig(block_size=target_runner.block_size, num_blocks=target_runner.kv_cache.num_blocks)
        # eager steps: the draft's decode graphs would need the target's step limits and memory accounting
        self.runner = ModelRunner(model, ckpt.config, cache, dataclasses.replace(device_config, cuda_graphs=False))
        self.path = ckpt.path
        log.info("speculative decoding: draft model %s (%.1fM parameters)", ckpt.path,
                 sum(p.numel() for p in model.parameters()) / 1e6)

    def fill(self, works: list[tuple[Sequence, SeqWork]]) -> None:
        """Replace each work's placeholder draft with the draft model's greedy tokens:
        one forward that catches each sequence up to its last token and proposes the
        first draft token, then one a token."""
        states = []
        for seq, w in works:
            st = seq.spec_state
            if not isinstance(st, _DraftState) or st.preemptions != seq.num_preemptions:
                st = seq.spec_state = _DraftState(preemptions=seq.num_preemptions)
            states.append(st)
        drafts: list[list[int]] = [[] for _ in works]
        plan = StepPlan()
        for (seq, w), st in zip(works, states):
            p = w.start_pos  # the last token's position
            plan.add(SeqWork(seq.seq_id, seq.token_slice(st.computed, p + 1), st.computed, w.block_table,
                             SampleRow(_GREEDY, ())))
        got = self.runner.execute(plan).token_ids
        for i, (seq, w) in enumerate(works):
            drafts[i].append(got[seq.seq_id])
            states[i].computed = w.start_pos + 1
        k_max = max(len(w.sample.draft) for _, w in works)
        for j in range(1, k_max):
            plan = StepPlan()
            live = [i for i, (_, w) in enumerate(works) if len(w.sample.draft) > j]
            for i in live:
                seq, w = works[i]
                plan.add(SeqWork(seq.seq_id, [drafts[i][-1]], w.start_pos + j, w.block_table, SampleRow(_GREEDY, ())))
            got = self.runner.execute(plan).token_ids
            for i in live:
                drafts[i].append(got[works[i][0].seq_id])
        for (seq, w), d in zip(works, drafts):
            w.sample.draft = tuple(d)
            seq.draft_ids = list(d)

    def verified(self, seq: Sequence, accepted: int) -> None:
        """Of the draft tokens fed to the draft (all but the last), those kept stay computed."""
        st = seq.spec_state
        if isinstance(st, _DraftState) and seq.draft_ids:
            st.computed += min(accepted, len(seq.draft_ids) - 1)


def _check_same_tokenizer(path: Path, target: Path) -> None:
    a, b = target / "tokenizer.json", path / "tokenizer.json"
    if a.is_file() and b.is_file() and json.loads(a.read_text())["model"] != json.loads(b.read_text())["model"]:
        raise ConfigError(f"draft model {path}: its tokenizer differs from the target's ({target})")
