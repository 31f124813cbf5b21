"""The detokenizer's work on each scheduler step: text deltas, stop strings, owners.

Mirrors SGLang's DetokenizerManager: a DecodeStatus per request, and all requests
of a step decoded with two batched tokenizer calls (surrogate windows, read
windows) per distinct (skip_special_tokens, spaces_between_special_tokens) pair,
usually one. Work per step is proportional to the requests in it.
"""

from collections import defaultdict
from dataclasses import dataclass, field

from services.common.pb import arrays_pb2, scheduler_pb2
from services.detokenizer.batch_decode import batch_decoder
from services.detokenizer.decode_status import DecodeStatus
from services.detokenizer.router import OwnedStep
from services.detokenizer.stop_strings import StopStrings

Reason = arrays_pb2.FinishReason


@dataclass
class RequestState:
    owner: str
    scheduler: str  # address of the scheduler running it
    skip_special_tokens: bool
    spaces_between_special_tokens: bool
    stops: StopStrings
    status: DecodeStatus = field(default_factory=DecodeStatus)

    @classmethod
    def of(cls, start: scheduler_pb2.RequestStart, scheduler: str) -> "RequestState":
        params = start.detokenize
        return cls(start.owner, scheduler, params.skip_special_tokens, params.spaces_between_special_tokens,
                   StopStrings.of(params.stop, params.no_stop_trim))


@dataclass
class _Entry:
    index: int  # position in the step's rids
    rid: str
    state: RequestState
    finish: scheduler_pb2.Finish | None  # the scheduler's, when the request ended this step


class DetokenizerManager:
    def __init__(self, tokenizer):
        self._batch_decode = batch_decoder(tokenizer)
        self.requests: dict[str, RequestState] = {}
        # Requests ended here by a stop string -> their scheduler, until the scheduler's own
        # Finish for them arrives (steps already in flight still carry them).
        self.stopped: dict[str, str] = {}

    def process(self, step: scheduler_pb2.StepOutput, scheduler: str) -> tuple[OwnedStep, list]:
        """One scheduler step -> (the step with texts and owners, AbortRequests to send to `scheduler`)."""
        for start in step.started:
            self.requests[start.rid] = RequestState.of(start, scheduler)
        scheduler_finish = {finish.rid: finish for finish in step.finished}
        owned = OwnedStep(step, texts=[""] * len(step.rids), owners=[None] * len(step.rids))
        entries = []
        for index, (rid, token) in enumerate(zip(step.rids, step.token_ids)):
            state = self.requests.get(rid)
            if state is None:  # ended here by a stop string, or never announced
                continue
            finish = scheduler_finish.get(rid)
            # Like SGLang, the stop token is not part of the text unless no_stop_trim.
            if not (finish and finish.reason == Reason.FINISH_REASON_STOP_TOKEN and not state.stops.no_stop_trim):
                state.status.decode_ids.append(token)
            owned.owners[index] = state.owner
            entries.append(_Entry(index, rid, state, finish))

        aborts = []
        for entry, (searched, text, printable_end) in zip(entries, self._decode(entries)):
            state, finish = entry.state, entry.finish
            match = state.stops.find(text, searched) if state.stops.strings else None
            if match:
                end = state.stops.text_end(text, match)
                if finish is None:  # still generating: tell the scheduler to stop it
                    aborts.append(scheduler_pb2.AbortRequest(rid=entry.rid, reason=Reason.FINISH_REASON_STOP_STRING,
                                                             matched_stop=match.stop))
                    self.stopped[entry.rid] = scheduler
                finish = scheduler_pb2.Finish(rid=entry.rid, reason=Reason.FINISH_REASON_STOP_STRING,
                                              matched_stop=match.stop)
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
            state = self.requests.get(finish.rid)
            owned.finished.append((state.owner if state else None, finish))
        owned.prompt_owners = [state.owner if (state := self.requests.get(rid)) else None
                               for rid in step.prompt_rids]
        for _, finish in owned.finished:
            self.requests.pop(finish.rid, None)
        return owned, aborts

    def requests_of(self, owner: str) -> list[tuple[str, str]]:
        """(rid, scheduler) of every running request that `owner` submitted."""
        return [(rid, state.scheduler) for rid, state in self.requests.items() if state.owner == owner]

    def drop_scheduler(self, scheduler: str) -> OwnedStep:
        """Its stream is gone: end its requests (their remaining steps are lost) and tell their owners."""
        owned = OwnedStep(scheduler_pb2.StepOutput())
        for rid in [rid for rid, state in self.requests.items() if state.scheduler == scheduler]:
            state = self.requests.pop(rid)
            owned.finished.append((state.owner, scheduler_pb2.Finish(
                rid=rid, reason=Reason.FINISH_REASON_ABORT, message=f"lost the step stream of scheduler {scheduler}")))
        for rid in [rid for rid, address in self.stopped.items() if address == scheduler]:
            del self.stopped[rid]
        return owned

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
