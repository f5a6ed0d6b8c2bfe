"""Decode instance choice: keep every instance's TBT within SLO, least loaded first."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from halfmoon.policy.cost import DecodeCostModel
from halfmoon.policy.state import SLO, DecodeInstanceState, MeasuredStep, slo_attainment


class TbtParts(NamedTuple):
    """What a decode instance's predicted TBT is made of, for a rejection to name: ``step_s``, the gap its
    steps give with the request added, and ``prompt_work_s`` of prompts queued there and the request's own,
    spread over ``spread_tokens`` of its decoding sequences' tokens (0: none counted). ``level_s``: its steps
    lately at ``at_batch`` sequences each, ``level_prompt_s`` of it what prompt chunks added (None: none
    measured), which set the level of ``step_s``."""

    step_s: float
    prompt_work_s: float
    spread_tokens: float
    level_s: float | None
    level_prompt_s: float
    at_batch: float

    def describe(self) -> str:
        work = (f" + prompt work {self.prompt_work_s:.2f}s over {self.spread_tokens:.0f} tokens"
                if self.prompt_work_s > 0 else "")
        level = ("" if self.level_s is None else f"; steps lately {self.level_s:.3f}s at batch {self.at_batch:.1f}"
                 + (f", {self.level_prompt_s:.3f}s of it prompts" if self.level_prompt_s > 0 else ""))
        return f"step {self.step_s:.3f}s{work}{level}"


# a paced prompt's chunks keep the steps they share to this share of the TBT SLO: the rest is for the prompts
# placed there after it, which are not paced, and for the engine's per-token figure running behind a context
# that grows with every chunk. Of 0.5-1.0 in the simulator (benchmarks/sim_paced_share.py) 0.75 turned away
# fewest, or within 0.1% of the fewest; at 0.5 the target was under the decode step and nothing was paced
PACED_STEP_SHARE = 0.75


class DecodeChoice(NamedTuple):
    """``parts``: what the prediction is made of (a rejection's nearest miss carries them).
    ``step_target_s`` (0: not paced): the request's prompt is admitted only paced, its chunks keeping the
    steps they share with the sequences decoding there within that many seconds; ``paced_prompt_s`` is then
    how long its prefill is predicted to take so (it replaces the prompt's own prefill in its TTFT)."""

    instance_id: str
    predicted_tbt_s: float
    parts: TbtParts | None = None
    step_target_s: float = 0.0
    paced_prompt_s: float = 0.0


class StepCorrection(NamedTuple):
    """How an instance's steps compare with the model: a prediction becomes ``predicted * factor + excess``."""

    factor: float = 1.0
    excess: float = 0.0

    def apply(self, predicted: float) -> float:
        return predicted * self.factor + self.excess


def step_correction(cost: DecodeCostModel, measured: MeasuredStep | None) -> StepCorrection | None:
    """What an instance's own latest steps say of the model (None: no steps lately). Faster than the model,
    every prediction shrinks in proportion: a model soured by a slow spell is too steep as well as too
    slow. Slower, the excess is added, not multiplied: a ratio learned where the model predicts little (a
    step of one sequence, mostly fixed cost the model put in its slope) and carried to a batch of nine
    turned tens of milliseconds of error into seconds."""
    if measured is None or measured.batch <= 0:
        return None
    expected = cost.predict(measured.batch, measured.context_tokens)
    if measured.seconds < expected:
        return StepCorrection(factor=measured.seconds / expected)
    return StepCorrection(excess=measured.seconds - expected)


def peer_correction(cost: DecodeCostModel, measured: Sequence[MeasuredStep | None]) -> StepCorrection | None:
    """The median correction of the instances that measured steps lately: what an instance without steps of
    its own is judged by. Judged by the bare model instead, an idle instance looked faster than every busy
    one whenever the machine ran slower than the model, and drew every request until its own steps came in."""
    corrections = [c for m in measured if (c := step_correction(cost, m)) is not None]
    if not corrections:
        return None
    middle = len(corrections) // 2
    return StepCorrection(sorted(c.factor for c in corrections)[middle], sorted(c.excess for c in corrections)[middle])


def anchored(cost: DecodeCostModel, measured: MeasuredStep | None, batch: float, context_tokens: float,
             peers: StepCorrection | None = None) -> float:
    """The step time of ``batch`` sequences over ``context_tokens``: the model's, corrected by how the
    instance's own latest steps compared with it (by ``peers``' correction when it has none). One model
    serves every instance, and an instance's steps slow with whatever else shares its cores; what it
    measured now is the truer level, the model the growth from there."""
    predicted = cost.predict(batch, context_tokens)
    correction = step_correction(cost, measured) or peers
    return predicted if correction is None else correction.apply(predicted)


class SloAwareDecode:
    """Chooses the decode instance for a request of ``context_tokens`` tokens.

    Contract: an instance qualifies when the request fits its KV capacity and the predicted
    step time with the request added stays within ``headroom * slo.tbt_s``. The qualifying
    instances share the load (the paper's rule: balance among those that meet the TBT SLO):
    the least loaded wins, load being the recent TBT-SLO violation rate plus the model's step time
    for its batch with the request as a share of the SLO (summed, so a lagging violation signal
    cannot herd; the instance's own steps decide whether it qualifies, not its share), then the batch
    size, so instances a flat cost model cannot tell apart take turns instead of the first
    by id taking everything.
    ``at=None`` judges the batch running now; a time judges the work expected to be running
    then (for prediction-based early rejection). Returns None when none qualify.
    ``idle_qualifies``: an instance with nothing running qualifies whatever its predicted TBT (when the
    cost model is learned from the steps instances run, refusing idle ones would stop the steps
    that could correct a model soured by a slow spell).
    ``shared_cost``: the step time of a decoding batch whose steps carry a prefill chunk. Given, an
    instance that interleaves prefill is judged by the time between tokens its decoding sequences see:
    its steps with this request decoding, and those a prompt chunk shares, mixed in the proportion the
    instance measured lately (``shared_step_fraction``); what a client measures as its time between
    tokens is that mean. Without a measured proportion, the slower of the two.
    ``decode_tokens`` (the request's ``max_tokens``; 0: not known): an instance that interleaves prefill
    qualifies only while the sequences decoding there stay within the SLO too: they see the prompt work
    queued there (``queued_prefill_s``) and this request's own (``prompt_s``, its predicted prefill) in
    their steps, spread over their tokens (``decoders_tokens``; where not known, as many as this request's),
    or, where it is slower, the pace of prompts its steps measured lately. The instance's recent steps say
    nothing of a burst just placed on it: judged by them alone, 26 prompts placed in 3 s were each predicted
    52-59 ms and got 140-1,226 ms between tokens. The prediction returned is the request's own.
    Paced: where the request's own prompt alone would hold those sequences past the SLO, an instance whose
    engine ``paces_prompts`` still qualifies with the prompt paced (``paced``): its chunks keep the steps
    they share within ``PACED_STEP_SHARE`` of the SLO, so the sequences see at most that, and the prompt
    takes longer, by the step over what the step leaves it. It must still start decoding within
    ``paced_budget_s`` (the TTFT the SLO leaves for its prefill). An instance that qualifies unpaced wins over
    any that needs pacing: the Sarathi-style trade of a prompt's TTFT for its neighbours' TBT is made only
    where admission would turn the prompt away otherwise. Left unpaced and turned away, a 2,725-token
    prompt beside eight decoding sequences of the Mooncake trace was rejected though the same load without
    admission served it within both SLOs.
    """

    def __init__(self, cost: DecodeCostModel, slo: SLO = SLO(), headroom: float = 1.0,
                 idle_qualifies: bool = False, shared_cost: DecodeCostModel | None = None) -> None:
        if headroom <= 0:
            raise ValueError(f"headroom must be positive, got {headroom}")
        self.cost = cost
        self.slo = slo
        self.headroom = headroom
        self.idle_qualifies = idle_qualifies
        self.shared_cost = shared_cost

    def predicted_tbt(self, inst: DecodeInstanceState, context_tokens: int, at: float | None = None,
                      peers: Sequence[DecodeInstanceState] = ()) -> float:
        """``peers``: the instances ``inst`` is compared with; their correction stands in for one it has not measured."""
        return self._predicted(inst, context_tokens, at, self._peer_corrections(peers))

    def decoders_tbt(self, inst: DecodeInstanceState, context_tokens: int, decode_tokens: int, prompt_s: float = 0.0,
                     peers: Sequence[DecodeInstanceState] = ()) -> float:
        """The mean gap of the sequences decoding on ``inst`` with this request admitted there
        (``_decoders_tbt``)."""
        corrections = self._peer_corrections(peers)
        tbt = self._predicted(inst, context_tokens, None, corrections)
        return self._decoders_tbt(inst, context_tokens, None, corrections, tbt, decode_tokens, prompt_s)

    def _peer_corrections(self, peers: Sequence[DecodeInstanceState]) -> tuple[StepCorrection | None, StepCorrection | None]:
        """The peers' corrections of decode-only steps and of steps shared with prefill: once per decision."""
        shared = (None if self.shared_cost is None
                  else peer_correction(self.shared_cost, [p.measured_shared for p in peers]))
        return peer_correction(self.cost, [p.measured for p in peers]), shared

    def _step(self, inst: DecodeInstanceState, context_tokens: int, at: float | None, peer: StepCorrection | None,
              own_steps: bool = True) -> float:
        """The instance's decode-only step with the request added."""
        batch, context = (inst.batch_size, inst.context_tokens) if at is None else inst.load_at(at)
        return anchored(self.cost, inst.measured if own_steps else None, batch + 1, context + context_tokens, peer)

    def _predicted(self, inst: DecodeInstanceState, context_tokens: int, at: float | None,
                   peers: tuple[StepCorrection | None, StepCorrection | None], own_steps: bool = True) -> float:
        """``own_steps=False`` with no peer corrections: the model alone."""
        tbt = self._step(inst, context_tokens, at, peers[0], own_steps)
        if self.shared_cost is not None and inst.interleaves_prefill:
            batch, context = (inst.batch_size, inst.context_tokens) if at is None else inst.load_at(at)
            measured_shared = inst.measured_shared if own_steps else None
            shared = anchored(self.shared_cost, measured_shared, batch, context + context_tokens, peers[1])
            fraction = inst.shared_step_fraction
            tbt = max(tbt, shared) if fraction is None else tbt + fraction * max(0.0, shared - tbt)
        return tbt

    def _decoders_tbt(self, inst: DecodeInstanceState, context_tokens: int, at: float | None,
                      peers: tuple[StepCorrection | None, StepCorrection | None], tbt: float, decode_tokens: int,
                      prompt_s: float) -> float:
        """The mean gap of the sequences decoding on ``inst`` (``tbt``: the request's own prediction): the
        slower of what its steps gave lately, prompts arriving at the pace they did, and its decode-only steps
        with the prompt work queued there and this request's own (``prompt_s``) spread over their tokens, a
        burst above that pace. Its own prompt counts unless nothing runs or waits there to be slowed: left
        out, a 2,725-token prompt (8.5 s of prefill) was admitted beside ten decoding sequences as the
        eleventh request of a burst, and they got 300 ms between tokens. Summed with the first, the second
        counted the steady pace of prompts twice, and beside a busy loop 17 of 48 requests of a steady load
        were turned away. Where both kinds of steps are measured as one window (``prefill_interference`` off,
        the default), the steps lately carry the pace already and the queue is added to them: the sequences
        decoding there have seen that pace so far and will see the queue next. Taken apart there, the slower of
        the two, requests admitted into the trace's bursts got 300 ms between tokens where the sum kept them
        at 156 ms."""
        if not inst.interleaves_prefill or decode_tokens <= 0 or self._spread(inst, decode_tokens) <= 1:
            return tbt
        return max(tbt, self._with_prompts(inst, context_tokens, at, peers[0], decode_tokens,
                                           self._own_prompt_s(inst, prompt_s)))

    @staticmethod
    def _own_prompt_s(inst: DecodeInstanceState, prompt_s: float) -> float:
        """The request's own prompt work as its decoders see it: none where nothing runs or waits there."""
        return prompt_s if inst.batch_size > 0 or inst.queued_prefill_s > 0 else 0.0

    def _with_prompts(self, inst: DecodeInstanceState, context_tokens: int, at: float | None,
                      peer: StepCorrection | None, decode_tokens: int, prompt_s: float) -> float:
        """Its step (decode-only where measured apart) with the queued prompt work (``_queue_gap``) and
        ``prompt_s`` more spread over its tokens."""
        step = self._step(inst, context_tokens, at, peer)
        spread = self._spread(inst, decode_tokens)
        return step + self._queue_gap(inst, step, spread) + prompt_s / spread

    def _queue_gap(self, inst: DecodeInstanceState, step: float, spread: float) -> float:
        """What the prompt work queued on ``inst`` adds to each gap of its decoders (``step`` their step,
        ``spread`` their tokens): the unpaced work spread over their tokens, and the paced work as far as its
        target leaves room beside their step. Spread whole, a prompt admitted paced counted as if it would be
        computed at full speed, and the requests arriving while it ran were kept out until it had."""
        return (inst.queued_prefill_s - inst.paced_prefill_s) / spread + self._paced_gap(inst, step, spread)

    def _paced_gap(self, inst: DecodeInstanceState, step: float, spread: float) -> float:
        """What the paced prompt work queued on ``inst`` adds to each gap of a sequence decoding ``spread``
        tokens beside it: spread over them, and at most what its target leaves beside their ``step``."""
        if inst.paced_prefill_s <= 0:
            return 0.0
        return min(inst.paced_prefill_s / spread, max(0.0, self.paced_step_s - step))

    def _own_tbt(self, inst: DecodeInstanceState, context_tokens: int, at: float | None,
                 peers: tuple[StepCorrection | None, StepCorrection | None], tbt: float, decode_tokens: int) -> float:
        """The request's own mean gap, admitted unpaced: ``tbt``, or where paced prompts are queued there, its
        step with their chunks in it as far as their target lets them. Its prompt goes in beside a paced
        prompt's chunks and decodes while they go on; the unpaced prompts queued ahead of it are done by its
        first token. Predicted at the step alone, the requests placed behind the trace's paced 2,725-token
        prompt were predicted 45 ms and got 144-223 ms between tokens, its 150 ms steps most of that."""
        tokens = decode_tokens or inst.decoders_tokens
        if not (inst.interleaves_prefill and inst.paced_prefill_s > 0 and tokens > 0):
            return tbt
        step = self._step(inst, context_tokens, at, peers[0])
        return max(tbt, step + self._paced_gap(inst, step, tokens))

    @property
    def paced_step_s(self) -> float:
        """The step a paced prompt's chunks keep within."""
        return PACED_STEP_SHARE * self.headroom * self.slo.tbt_s

    @staticmethod
    def _spread(inst: DecodeInstanceState, decode_tokens: int) -> float:
        """The tokens the sequences decoding on ``inst`` spread prompt work over: theirs where known, else
        as many as this request's. Taken from the request alone, a 3,300-token prompt asking for 8 tokens was
        turned away beside six sequences of 300 tokens, whose gaps its 5 s of prefill would have raised by
        17 ms. A spread of one token (a request for one token, nothing else known) has no gap for prompt work
        to lengthen: prompt work is not spread over it. Spread over a lone one-token request, the prompts
        queued as a trace's burst ended, beside a busy loop, were predicted at 0.7-3.0 s between tokens, and
        16 requests that had waited for the burst to pass were turned away as it passed."""
        return inst.decoders_tokens if inst.decoders_tokens > 0 else float(decode_tokens)

    def clears_in(self, instances: Sequence[DecodeInstanceState], context_tokens: int, at: float | None = None,
                  decode_tokens: int = 0, prompt_s: float = 0.0) -> float | None:
        """Seconds until a request no instance qualifies for now would qualify on one, counting the prompt
        work queued there draining and the pace of prompts its steps lately carried (``prompt_excess_s``)
        passing, each about a second of work a second: where the instance's steps, and its steps with this
        request's prompt (``prompt_s``) in them, are within the SLO once those two are gone. None where no
        instance is kept out by them alone: waiting would not let this request in. The pace passes as the
        steps that carried it leave the window: turned away on it instead, beside a busy loop, 22 requests of
        a steady load were kept out at a predicted 0.209 s after a wave's prompts, requests the same load
        served at 125-180 ms without admission. A prompt too long to join unpaced even alone waits, on an
        instance that ``paces_prompts``, for the queue to drain enough that it can join paced: turned away
        instead, the trace's 2,725-token prompt, placed 20 ms after nine others of its burst, got a 429."""
        limit = self.headroom * self.slo.tbt_s
        peers = self._peer_corrections(instances)
        drains = []
        for inst in instances:
            spread = self._spread(inst, decode_tokens)
            if not (self.fits(inst, context_tokens, at) and inst.interleaves_prefill and decode_tokens > 0
                    and spread > 1):
                continue
            step = self._step(inst, context_tokens, at, peers[0])
            queue_gap = self._queue_gap(inst, step, spread)
            with_queue = step + queue_gap + prompt_s / spread
            passing = inst.prompt_excess_s
            if self._predicted(inst, context_tokens, at, peers) - passing > limit:
                continue
            if with_queue - queue_gap - passing <= limit:
                drains.append(max(0.0, with_queue - limit) * spread)
            if inst.paces_prompts and step < self.paced_step_s and step + queue_gap > limit:
                drains.append((step + queue_gap - limit) * spread)
        return min(drains, default=None)

    def fits(self, inst: DecodeInstanceState, context_tokens: int, at: float | None = None) -> bool:
        context = inst.context_tokens if at is None else inst.load_at(at)[1]
        return context + context_tokens <= inst.capacity_tokens

    def choose(
        self, instances: Sequence[DecodeInstanceState], context_tokens: int, at: float | None = None,
        decode_tokens: int = 0, prompt_s: float = 0.0, paced_budget_s: float = 0.0,
    ) -> DecodeChoice | None:
        limit = self.headroom * self.slo.tbt_s
        peers = self._peer_corrections(instances)
        best: tuple[bool, float, int, float, str] | None = None
        pacing: dict[str, tuple[float, float]] = {}
        for inst in instances:
            if not self.fits(inst, context_tokens, at):
                continue
            tbt = self._predicted(inst, context_tokens, at, peers)
            batch = inst.batch_size if at is None else inst.load_at(at)[0]
            if (self._decoders_tbt(inst, context_tokens, at, peers, tbt, decode_tokens, prompt_s) > limit
                    and not (self.idle_qualifies and batch == 0)):
                paced = self.paced(inst, context_tokens, at, peers, tbt, decode_tokens, prompt_s)
                if paced is None or paced[1] > paced_budget_s:
                    continue
                pacing[inst.id] = paced
            # the share is weighed by the model alone: an instance's correction (its latest steps) is noise
            # of a few tens of percent between instances on shared cores, and with a model flat in the batch,
            # weighing it gave the one measured fastest nearly every request
            shape = self._predicted(inst, context_tokens, at, (None, None), own_steps=False)
            load = 1.0 - slo_attainment(inst.recent_tbt, self.slo.tbt_s) + shape / self.slo.tbt_s
            if inst.id not in pacing:
                tbt = self._own_tbt(inst, context_tokens, at, peers, tbt, decode_tokens)
            key = (inst.id in pacing, round(load, 6), batch, tbt, inst.id)
            if best is None or key < best:
                best = key
        if best is None:
            return None
        target, paced_s = pacing.get(best[4], (0.0, 0.0))
        return DecodeChoice(best[4], best[3], step_target_s=target, paced_prompt_s=paced_s)

    def paced(self, inst: DecodeInstanceState, context_tokens: int, at: float | None,
              peers: tuple[StepCorrection | None, StepCorrection | None], tbt: float, decode_tokens: int,
              prompt_s: float) -> tuple[float, float] | None:
        """(step target, paced prefill seconds) where ``inst`` takes the request with its prompt paced, or None:
        it does not pace, the request's own prompt is not what keeps it out, or its decode-only step leaves
        the target no room. The sequences there see the prompt work queued ahead of it as before, and at most
        the target while its chunks share their steps; each of its steps computes what the target leaves of
        the decode-only step, so the prefill stretches by target / room."""
        own = self._own_prompt_s(inst, prompt_s)
        if not (inst.paces_prompts and inst.interleaves_prefill and own > 0):
            return None
        target = self.paced_step_s
        without_own = self._decoders_tbt(inst, context_tokens, at, peers, tbt, decode_tokens, 0.0)
        room = target - self._step(inst, context_tokens, at, peers[0])
        if without_own > self.headroom * self.slo.tbt_s or room <= 0:
            return None
        return target, prompt_s * target / room

    def nearest(
        self, instances: Sequence[DecodeInstanceState], context_tokens: int, at: float | None = None,
        decode_tokens: int = 0, prompt_s: float = 0.0,
    ) -> DecodeChoice | None:
        """The instance with the lowest predicted TBT (counting its queued prompts' work) among those the
        request fits, qualifying or not: what a rejection reports (None when it fits none)."""
        peers = self._peer_corrections(instances)
        predicted = [(self._decoders_tbt(inst, context_tokens, at, peers, self._predicted(inst, context_tokens, at, peers),
                                         decode_tokens, prompt_s), inst.id, inst)
                     for inst in instances if self.fits(inst, context_tokens, at)]
        if not predicted:
            return None
        tbt, instance_id, inst = min(predicted, key=lambda p: p[:2])
        return DecodeChoice(instance_id, tbt, self._parts(inst, context_tokens, at, peers, tbt, decode_tokens, prompt_s))

    def _parts(self, inst: DecodeInstanceState, context_tokens: int, at: float | None,
               peers: tuple[StepCorrection | None, StepCorrection | None], tbt: float, decode_tokens: int,
               prompt_s: float) -> TbtParts:
        """The parts of ``tbt``, the prediction ``_decoders_tbt`` made for ``inst``: the prompt work is what its
        decoders see of it, paced work as far as its target lets it."""
        work, spread, level = 0.0, self._spread(inst, decode_tokens), inst.measured
        step = tbt
        if inst.interleaves_prefill and decode_tokens > 0 and tbt > self._predicted(inst, context_tokens, at, peers):
            step = self._step(inst, context_tokens, at, peers[0])
            work = (tbt - step) * spread
        return TbtParts(step, work, spread, None if level is None else level.seconds,
                        inst.prompt_excess_s, 0.0 if level is None else level.batch)
