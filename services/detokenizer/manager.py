"""The detokenizer's work on each scheduler step: text deltas, stop strings, owners.

Mirrors SGLang's DetokenizerManager: a DecodeStatus per request, and all requests
of a step decoded with two batched tokenizer calls (surrogate windows, read
windows) per distinct (skip_special_tokens, spaces_between_special_tokens) pair,
usually one. Work per step is proportional to the requests in it.

Each request's tokens are taken in position order, exactly once (flatwire_wire.steps
entry_order): an entry held already (a replay after the step stream was cut; a replay
repeats entries whole) is skipped, one that starts past the next expected position or
straddles it (which a consistent replay never leaves) fails the request. An entry of several tokens (a
request that does not stream) is decoded as one piece: its text is one delta. The
tokens a request resumed from its output ids (RequestResume) misses here are
decoded one per step, as the original steps did, so its text deltas are the same
to the character as if nothing had happened.
"""

from collections import defaultdict
from dataclasses import dataclass, field

from flatwire_wire.scheduler import AbortRequest
from flatwire_wire.steps import EntryOrder, Finish, FinishReason, RequestStart, StepMessage, entry_order, lost_output

from services.detokenizer.batch_decode import BatchDecode
from services.detokenizer.decode_status import DecodeStatus
from services.detokenizer.router import OwnedStep
from services.detokenizer.stop_strings import StopStrings


@dataclass
class DecodingRequest:
    owner: str
    scheduler: str  # address of the scheduler running it
    skip_special_tokens: bool
    spaces_between_special_tokens: bool
    stops: StopStrings
    min_new_tokens: int  # stop strings match only once the output is this long (SGLang's min_new_tokens)
    status: DecodeStatus = field(default_factory=DecodeStatus)
    next_position: int = 0  # of the next output token to decode

    @classmethod
    def of(cls, start: RequestStart, scheduler: str) -> "DecodingRequest":
        params = start.detokenize
        return cls(start.owner, scheduler, params.skip_special_tokens, params.spaces_between_special_tokens,
                   StopStrings.of(params.stop, params.no_stop_trim, params.include_stop_str), params.min_new_tokens)


@dataclass
class _Entry:
    index: int  # position in the step's rids
    rid: str
    state: DecodingRequest
    finish: Finish | None  # the scheduler's, when the request ended this step


class DetokenizerManager:
    def __init__(self, batch_decode: BatchDecode):
        self._batch_decode = batch_decode
        self.requests: dict[str, DecodingRequest] = {}
        # Requests ended here by a stop string -> their scheduler, until the scheduler's own
        # Finish for them arrives (steps already in flight still carry them).
        self.stopped: dict[str, str] = {}

    def expand(self, step: StepMessage) -> list[StepMessage]:
        """The step, preceded by one step per position of the tokens its resumed requests miss here."""
        behind = [resume for resume in step.resumed if resume.start.rid not in self.requests
                  or self.requests[resume.start.rid].next_position < len(resume.output_ids)]
        if not behind:
            return [step]
        steps = [StepMessage(started=[resume.start for resume in behind])]  # known ones: ignored
        for position in range(max(len(resume.output_ids) for resume in behind)):
            level = [resume for resume in behind if position < len(resume.output_ids)]
            steps.append(StepMessage(rids=[resume.start.rid for resume in level],
                                     token_ids=[resume.output_ids[position] for resume in level],
                                     positions=[position] * len(level), counts=[1] * len(level)))
        return [*steps, step]

    def process(self, step: StepMessage, scheduler: str) -> tuple[OwnedStep, list[AbortRequest]]:
        """One scheduler step -> (the step with texts and owners, aborts to send to `scheduler`)."""
        for start in step.started:
            if start.rid not in self.requests:  # a replayed start of a request known here changes nothing
                self.requests[start.rid] = DecodingRequest.of(start, scheduler)
        scheduler_finish = {finish.rid: finish for finish in step.finished}
        owned = OwnedStep(step, texts=[""] * len(step.rids), owners=[None] * len(step.rids))
        entries: list[_Entry] = []
        aborts: list[AbortRequest] = []
        for index, ((rid, tokens), position) in enumerate(zip(step.entries(), step.positions)):
            count = len(tokens)
            state = self.requests.get(rid)
            if state is None:  # ended here already, or never announced
                continue
            order = entry_order(position, count, state.next_position)
            if order is EntryOrder.HELD:
                continue
            if order is not EntryOrder.NEXT:
                lost = lost_output(order, position, count, state.next_position)
                why = f"detokenizer: {lost} from scheduler {scheduler}"
                owned.finished.append((state.owner, self._fail(rid, why)))
                aborts.append(AbortRequest(rid=rid, reason=FinishReason.ERROR, message=why))
                continue
            state.next_position += count
            finish = scheduler_finish.get(rid)
            # Like SGLang, the stop token is not part of the text unless no_stop_trim (or vLLM's include_stop_str).
            if finish and finish.reason == FinishReason.STOP_TOKEN and not state.stops.keeps_stop_token:
                tokens = tokens[:-1]
            state.status.decode_ids.extend(tokens)
            owned.owners[index] = state.owner
            entries.append(_Entry(index, rid, state, finish))

        for entry, (searched, text, printable_end) in zip(entries, self._decode(entries)):
            state, finish = entry.state, entry.finish
            matching = state.stops.strings and state.next_position >= state.min_new_tokens
            match = state.stops.find(text, searched) if matching else None
            if match:
                end = state.stops.text_end(text, match)
                if finish is None:  # still generating: tell the scheduler to stop it
                    aborts.append(AbortRequest(rid=entry.rid, reason=FinishReason.STOP_STRING, matched_stop=match.stop))
                    self.stopped[entry.rid] = scheduler
                finish = Finish(rid=entry.rid, reason=FinishReason.STOP_STRING, matched_stop=match.stop,
                                output_tokens=state.next_position)
            elif finish:
                end = len(text)
            else:
                end = printable_end - state.stops.partial_len(text, printable_end)
            owned.texts[entry.index] = state.status.take(text, end)
            if finish:
                owned.finished.append((state.owner, finish))

        in_step = {entry.rid for entry in entries}
        for finish in step.finished:
            if finish.rid in in_step:
                continue
            if self.stopped.pop(finish.rid, None) is not None:  # already reported as STOP_STRING
                continue
            if state := self.requests.get(finish.rid):  # unknown: finished here already (a replay)
                owned.finished.append((state.owner, finish))
        owned.prompt_owners = [state.owner if (state := self.requests.get(rid)) else None
                               for rid in step.prompt_rids]
        for _, finish in owned.finished:
            self.requests.pop(finish.rid, None)
        return owned, aborts

    def requests_of(self, owner: str) -> list[tuple[str, str]]:
        """(rid, scheduler) of every running request that `owner` submitted."""
        return [(rid, state.scheduler) for rid, state in self.requests.items() if state.owner == owner]

    def drop_scheduler(self, scheduler: str, why: str) -> OwnedStep:
        """Its requests cannot go on (it restarted, or stayed away): fail them and tell their owners."""
        for rid in [rid for rid, address in self.stopped.items() if address == scheduler]:
            del self.stopped[rid]
        return self.fail([rid for rid, state in self.requests.items() if state.scheduler == scheduler], why)

    def fail(self, rids, why: str) -> OwnedStep:
        """Fail those of `rids` running here (FINISH_REASON_ERROR to their owners)."""
        owned = OwnedStep(StepMessage())
        for rid in [rid for rid in rids if rid in self.requests]:
            owned.finished.append((self.requests[rid].owner, self._fail(rid, why)))
        return owned

    def drop_owner(self, owner: str) -> list[tuple[str, str]]:
        """Forget a gateway's requests; returns their (rid, scheduler) to abort."""
        requests = self.requests_of(owner)
        for rid, _ in requests:
            del self.requests[rid]
        return requests

    def _fail(self, rid: str, why: str) -> Finish:
        state = self.requests.pop(rid)
        return Finish(rid=rid, reason=FinishReason.ERROR, message=why, output_tokens=state.next_position)

    def _decode(self, entries: list[_Entry]) -> list[tuple[int, str, int]]:
        """Per entry: (confirmed length before this step, whole text, streamable length)."""
        groups: dict[tuple[bool, bool], list[int]] = defaultdict(list)
        for n, entry in enumerate(entries):
            groups[entry.state.skip_special_tokens, entry.state.spaces_between_special_tokens].append(n)
        results: list = [None] * len(entries)
        for (skip, spaces), members in groups.items():
            statuses = [entries[n].state.status for n in members]
            surr_texts = self._batch_decode([s.surr_ids() for s in statuses], skip, spaces)
            read_texts = self._batch_decode([s.read_ids() for s in statuses], skip, spaces)
            for n, status, surr_text, read_text in zip(members, statuses, surr_texts, read_texts):
                searched = len(status.decoded_text)
                results[n] = (searched, *status.advance(surr_text, read_text))
        return results
