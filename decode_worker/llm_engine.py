"""LLMEngine: the decode worker's synchronous core. One `step()` = schedule, one
forward for everyone, retire finished sequences. Token ids in, token events out;
text and stop strings are handled by whoever owns the tokenizer (engine/output.py).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from engine.build import build_parts
from engine.config import ConfigError, EngineConfig
from engine.events import TokenEvent, TokenLogprobs, Usage
from engine.kv_offload import tier_driver
from engine.plan import DEAD_END
from engine.runner import Launched, ModelRunner
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.scheduler import Reservation, Scheduler, SchedulerOutput
from engine.sequence import INTERACTIVE, FinishReason, Sequence, Status
from engine.speculative import SpecDecoding, make_proposer
from engine.structured import StructuredOutputs, attach_grammar

log = logging.getLogger(__name__)


@dataclass
class StepStats:
    num_steps: int = 0
    num_tokens: int = 0
    forward_s: float = 0.0
    last_step_s: float = 0.0


class LLMEngine:
    def __init__(self, runner: ModelRunner, scheduler: Scheduler, eos_ids: frozenset[int],
                 structured: StructuredOutputs | None = None, spec: SpecDecoding | None = None) -> None:
        self.runner = runner
        self.spec = spec
        self.structured = structured
        self.scheduler = scheduler
        self.pool = scheduler.pool
        self.eos_ids = eos_ids
        self.stats = StepStats()
        self.seqs: dict[str, Sequence] = {}
        self._last_plan = None
        self.on_forward = None  # optional (num_tokens, forward_s, decode_only) -> None, e.g. metrics
        # asynchronous scheduling: the next step is planned and launched while the device
        # runs this one (`_step_ahead`); on by default where a step runs apart from the host
        setting = scheduler.config.async_scheduling
        if setting and spec is not None:
            raise ConfigError("--async-scheduling does not combine with speculative decoding (a step's drafts come "
                              "from the tokens before it)")
        self.async_scheduling = (runner.device.type == "cuda" and spec is None) if setting is None else setting
        if self.async_scheduling:
            log.info("asynchronous scheduling: each decode step is planned while the device runs the one before")
        self._inflight: tuple[SchedulerOutput, Launched] | None = None  # launched, not yet collected
        self.steps_ahead = 0  # steps launched ahead of the previous step's tokens
        self.tiers = tier_driver(runner, scheduler.cache)  # KV tiers below the device, or None

    @classmethod
    def from_config(cls, config: EngineConfig, checkpoint=None) -> "LLMEngine":
        parts = build_parts(config, checkpoint)
        spec = None
        if config.speculative.enabled:
            spec = SpecDecoding(config.speculative, make_proposer(config.speculative, parts.runner, config.device,
                                                                  parts.checkpoint.path))
        engine = cls(parts.runner, Scheduler(parts.scheduler_config, parts.pool), parts.eos_ids, parts.structured,
                     spec)
        engine.checkpoint = parts.checkpoint
        return engine

    @property
    def max_model_len(self) -> int:
        return self.scheduler.config.max_model_len

    # ---- requests ------------------------------------------------------------
    def new_sequence(self, seq_id: str, prompt_ids: list[int], params: SamplingParams,
                     priority: int = INTERACTIVE, arrival: float | None = None, output_ids=(),
                     grammar=None) -> Sequence:
        """`grammar`: the matcher of params' structured-output spec, compiled off this
        thread already (compiled here when not given)."""
        if seq_id in self.seqs:
            raise ValueError(f"request id {seq_id!r} is already in use")
        if len(output_ids) >= params.max_tokens:
            raise ValueError(f"{len(output_ids)} tokens already generated; max_tokens is {params.max_tokens}")
        seq = Sequence(seq_id, list(prompt_ids), params, self.eos_ids, priority,
                       time.monotonic() if arrival is None else arrival, output_ids=list(output_ids))
        attach_grammar(self.structured, seq, grammar)
        return seq

    def add_request(self, seq_id: str, prompt_ids: list[int], params: SamplingParams,
                    priority: int = INTERACTIVE, arrival: float | None = None, output_ids=(),
                    grammar=None) -> Sequence:
        """Queue a request for a local (colocated) prefill and decode. `output_ids`: tokens
        generated for it elsewhere (a migrated request), prefilled with the prompt."""
        seq = self.new_sequence(seq_id, prompt_ids, params, priority, arrival, output_ids, grammar)
        self.scheduler.add(seq)
        self.seqs[seq_id] = seq
        return seq

    def reserve(self, seq_id: str, prompt_ids: list[int], params: SamplingParams,
                priority: int = INTERACTIVE, grammar=None) -> Reservation:
        """Hold blocks for a prompt whose KV a prefill worker will write (its deadline
        is the caller's handoff ledger's)."""
        if params.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs need every prompt position computed here: prefill it locally")
        seq = self.new_sequence(seq_id, prompt_ids, params, priority, grammar=grammar)
        # a sequence that ended since the step on the device was launched gave back its
        # blocks, and that step still writes one more token's KV into one of them: it
        # must be done before a block goes to a writer outside the device's stream
        self.wait_inflight()
        res = self.scheduler.reserve(seq)
        if self.tiers is not None:
            self.tiers.move()  # what it evicted to the tiers below leaves before a remote write lands
        self.seqs[seq_id] = seq
        return res

    def wait_inflight(self) -> None:
        """Return once the step on the device (if any) has run: before blocks go to a
        writer or reader outside the device's stream (a reservation, a push to a peer)."""
        if self._inflight is not None:
            self.runner.wait(self._inflight[1])

    def mark_landed(self, seq_id: str, first_token: int, logprobs: TokenLogprobs | None = None) -> TokenEvent:
        seq = self.scheduler.mark_landed(seq_id, first_token)
        ev = self._event(seq, None if first_token == DEAD_END else first_token, logprobs)
        self._forget_if_done(seq)
        return ev

    def quarantine(self, seq_id: str) -> bool:
        """An unlanded reservation ended: it is no longer a request, but its blocks stay
        held until `release` (a late write may still land in them)."""
        self.seqs.pop(seq_id, None)
        return self.scheduler.quarantine(seq_id) is not None

    def release(self, seq_id: str, reason: FinishReason = FinishReason.ABORT) -> bool:
        """Free a reservation's blocks, awaiting or quarantined."""
        seq = self.scheduler.release_reservation(seq_id, reason)
        if seq is not None:
            self.seqs.pop(seq_id, None)
        return seq is not None

    def abort(self, seq_id: str) -> bool:
        seq = self.scheduler.abort(seq_id)
        self.seqs.pop(seq_id, None)
        return seq is not None

    def has_work(self) -> bool:
        return self._inflight is not None or self.scheduler.has_work()

    # ---- one iteration -------------------------------------------------------
    def step(self) -> list[TokenEvent]:
        if self.spec is None:
            return self._step()
        t0 = time.perf_counter()
        self.spec.propose(self.scheduler.running, self.max_model_len)
        events = self._step()
        decode_only = bool(self._last_plan) and not self._last_plan.prefills
        self.spec.observe_step(sum(ev.token_id is not None for ev in events), time.perf_counter() - t0, decode_only)
        return events

    def _step(self) -> list[TokenEvent]:
        if self._inflight is not None:
            return self._step_ahead()
        tiers = self.tiers
        if tiers is not None:
            tiers.poll()
        out: SchedulerOutput = self.scheduler.schedule()
        self._last_plan = out.plan
        if tiers is not None:
            tiers.move(idle=not out.plan)
        if not out.plan:
            return []
        if self.spec is not None and self.spec.fills_after_schedule:
            by_id = {seq.seq_id: seq for seq, _ in out.scheduled}
            self.spec.fill([(by_id[w.seq_id], w) for w in out.plan.decodes])
        if self.async_scheduling and self._launchable(out):
            self._inflight = (out, self.runner.launch(out.plan))
            return self._step_ahead()
        return self._finish(out, self.runner.execute(out.plan))

    def _launchable(self, out: SchedulerOutput) -> bool:
        """Whether a step from the ordinary `schedule` can be launched (and steps planned
        ahead of it): every sequence samples one token, on the device (ModelRunner.launch,
        Scheduler.schedule_ahead rely on this check)."""
        works = out.plan.works()
        return (all(w.sample is not None and not w.prompt_targets for w in works)
                and Sampler.deferrable([w.sample for w in works]))

    def _step_ahead(self) -> list[TokenEvent]:
        """Asynchronous scheduling (vLLM's): with step n launched, plan and launch step n+1
        on the tokens n samples (read on the device), then wait for n's tokens and retire
        them, while the device runs n+1. The host's scheduling and input building overlap
        the device's forward pass instead of following it. When the next step cannot be
        planned ahead (`Scheduler.schedule_ahead`), n is collected alone and the next call
        schedules as usual. Events come one step later than a synchronous step's would."""
        out, launched = self._inflight
        self._inflight = None
        ahead = self.scheduler.schedule_ahead(out)
        if ahead is not None and ahead.plan:
            if self.tiers is not None:
                self.tiers.move()
            self._inflight = (ahead, self.runner.launch(ahead.plan, after=launched))
            self.steps_ahead += 1
        self._last_plan = out.plan
        return self._finish(out, self.runner.collect(launched))

    def _finish(self, out: SchedulerOutput, result) -> list[TokenEvent]:
        events: list[TokenEvent] = []
        self.stats.num_steps += 1
        self.stats.num_tokens += result.num_tokens
        self.stats.forward_s += result.forward_s
        self.stats.last_step_s = result.forward_s
        if self.on_forward is not None:
            self.on_forward(result.num_tokens, result.forward_s, not out.plan.prefills)
        if self.tiers is not None and out.plan.prefills and not out.plan.decodes:
            self.tiers.index.cost.observe_prefill(result.num_tokens, result.forward_s)
        if result.accepted:
            return self._spec_events(out, result)
        ids, lps = result.token_ids, result.logprobs
        for seq in self.scheduler.update(out, ids, result.prompt_logprobs):
            sid = seq.seq_id
            tok = ids[sid]
            events.append(self._event(seq, None if tok == DEAD_END else tok, lps.get(sid)))
            self._forget_if_done(seq)
        if self.spec is not None:
            for seq, _ in out.scheduled:
                seq.draft_ids = []
        return events

    def _spec_events(self, out: SchedulerOutput, result) -> list[TokenEvent]:
        """A step that verified drafts: an event for each token a sequence got (in order;
        the last one carries the end), and the drafts booked."""
        before = {seq.seq_id: len(seq.output_ids) for seq, _ in out.scheduled}
        events: list[TokenEvent] = []
        for seq in self.scheduler.update(out, result.token_ids, result.prompt_logprobs, result.accepted):
            kept = result.accepted.get(seq.seq_id, [])
            self.spec.book(seq, len(kept))
            lps = [*result.accepted_logprobs.get(seq.seq_id, []), result.logprobs.get(seq.seq_id)]
            new = seq.output_ids[before[seq.seq_id]:]
            n0 = before[seq.seq_id]
            for i, tok in enumerate(new):
                events.append(self._event(seq, tok, lps[i] if i < len(lps) else None, num_output=n0 + i + 1))
            if not new:  # a dead end: no token, only the end
                events.append(self._event(seq, None))
            self._forget_if_done(seq)
        for seq, _ in out.scheduled:
            seq.draft_ids = []
        return events

    def _event(self, seq: Sequence, token: int | None, logprobs: TokenLogprobs | None = None,
               num_output: int | None = None) -> TokenEvent:
        """`num_output`: this token's place in the output, when a step gave the sequence
        several (only the last one, which is the sequence's newest, carries its end)."""
        num_out = len(seq.output_ids)
        n = num_out if num_output is None else num_output
        last = n == num_out
        first = n == 1 and token is not None and seq.params.prompt_logprobs is not None
        ev = TokenEvent(seq_id=seq.seq_id, token_id=token, completion_tokens=n, logprobs=logprobs)
        if last and seq.status is Status.FINISHED:
            ev.finished, ev.finish_reason = True, seq.finish_reason
            ev.usage = Usage(prompt_tokens=len(seq.prompt_ids), cached_tokens=seq.num_cached_tokens,
                             completion_tokens=n, draft_tokens=seq.num_drafted, accepted_tokens=seq.num_accepted)
        if first:
            ev.prompt_logprobs = list(seq.prompt_logprobs)
        return ev

    def _forget_if_done(self, seq: Sequence) -> None:
        if seq.is_finished:
            self.seqs.pop(seq.seq_id, None)
            if self.spec is not None:
                self.spec.finished(seq)

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
