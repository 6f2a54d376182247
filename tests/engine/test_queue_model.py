"""The lease table against a plain reference model (Hypothesis state machine).

Method: a real `Topic` with a `JobQueue` attached is driven directly (no engine, no
HTTP), with time as an explicit argument: every rule passes the same virtual `now` to
the queue and to the model. The model is the obvious, slow version of the spec: a dict
of jobs, each ready, leased or delayed, and a claim sorts every ready job by
(priority descending, seq ascending). Rules publish jobs (with priorities), claim (with
dead-lettering after `MAX_DELIVERIES`), ack (the delete committing or failing), nack
(with and without delay), extend, delete records behind the queue's back, and move time
across lease and delay boundaries, in any order. After every step the counts must agree.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from topicd.engine.queues import Claimer, JobQueue, lease_token
from topicd.engine.topic import Topic
from topicd.model import TopicConfig

MAX_DELIVERIES = 3
NODES = st.sampled_from(["a", "b"])
LEASES = st.sampled_from([100, 250, 1000])


@dataclass
class Job:
    prio: int
    state: str = "ready"  # ready | leased | delayed
    node: str = ""
    lease_id: int = 0
    expires_at: float = 0.0
    ready_at: float = 0.0
    deliveries: int = 0


class LeaseTableMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.topic = Topic("q", 1, TopicConfig(type="queue"), name_json=b'"q"')
        self.queue = JobQueue(self.topic, 1)
        self.topic.queue = self.queue
        self.jobs: dict[int, Job] = {}
        self.next_lease = 1
        self.now_ms = 0
        self.stale: dict[int, int] = {}  # seq -> a lease id it no longer holds

    @property
    def now(self) -> float:
        return self.now_ms / 1000

    # ---- the model --------------------------------------------------------------------

    def model_sweep(self) -> None:
        now = self.now
        for job in self.jobs.values():
            due = {"leased": job.expires_at, "delayed": job.ready_at}.get(job.state)
            if due is not None and now >= due:
                job.state = "ready"

    def holds(self, seq: int, node: str, fence: str) -> bool:
        job = self.jobs.get(seq)
        if job is None or job.state != "leased" or job.node != node:
            return False
        return not fence or fence == lease_token(job.lease_id)

    def fence_for(self, seq: int, kind: str) -> str:
        job = self.jobs.get(seq)
        if kind == "current" and job is not None and job.lease_id:
            return lease_token(job.lease_id)
        if kind == "stale" and seq in self.stale:
            return lease_token(self.stale[seq])
        return ""

    # ---- rules ------------------------------------------------------------------------

    @rule(prios=st.lists(st.integers(-2, 2), min_size=1, max_size=4))
    def publish(self, prios: list[int]) -> None:
        first = self.topic.head_seq + 1
        n = len(prios)
        encs = [b'{"$seq":%d,"$ts":0,"data":%d}' % (first + i, i) for i in range(n)]
        extras = {i: p for i, p in enumerate(prios) if p}
        self.topic.publish(first, 0, encs, [1] * n, n, {}, {}, extras, {})
        for i, p in enumerate(prios):
            self.jobs[first + i] = Job(p)

    @rule(node=NODES, want=st.integers(1, 4), lease_ms=LEASES, move_ok=st.booleans())
    def claim(self, node: str, want: int, lease_ms: int, move_ok: bool) -> None:
        self.model_sweep()
        order = sorted(
            (s for s, j in self.jobs.items() if j.state == "ready"),
            key=lambda s: (-self.jobs[s].prio, s),
        )
        expected: list[tuple[int, int]] = []
        diverted_model: list[int] = []
        for seq in order:
            if len(expected) == want:
                break
            job = self.jobs[seq]
            if job.deliveries + 1 > MAX_DELIVERIES:
                diverted_model.append(seq)
                continue
            job.deliveries += 1
            if job.lease_id:
                self.stale[seq] = job.lease_id
            job.state, job.node, job.lease_id = "leased", node, self.next_lease
            job.expires_at = self.now + lease_ms / 1000 + 0.001
            self.next_lease += 1
            expected.append((seq, job.deliveries))

        self.queue.sweep(self.now)
        me = Claimer(node, want, lease_ms)
        diverted = self.queue.claim([me], self.now, self.now_ms, MAX_DELIVERIES, True)
        assert [(lease.seq, n) for lease, n in me.got] == expected
        assert [lease.lease_id for lease, _ in me.got] == [
            self.jobs[s].lease_id for s, _ in expected
        ]
        assert diverted == diverted_model
        if move_ok:  # the dead-letter move committed: the job is deleted
            self.topic.delete_seqs(diverted)
            for seq in diverted:
                del self.jobs[seq]
        else:
            self.queue.release_held(diverted)

    def pick(self, data: st.DataObject) -> tuple[list[int], list[str]]:
        known = sorted(self.jobs) or [1]
        seqs = data.draw(
            st.lists(st.one_of(st.sampled_from(known), st.integers(1, 40)), max_size=4)
        )
        kinds = data.draw(
            st.lists(
                st.sampled_from(["none", "current", "stale"]),
                min_size=len(seqs),
                max_size=len(seqs),
            )
        )
        fences = [self.fence_for(s, k) for s, k in zip(seqs, kinds, strict=True)]
        return seqs, fences if any(fences) else []

    @rule(node=NODES, data=st.data(), commit_ok=st.booleans())
    def ack(self, node: str, data: st.DataObject, commit_ok: bool) -> None:
        seqs, fences = self.pick(data)
        self.model_sweep()
        exp_held: list[int] = []
        exp_skipped: list[int] = []
        for i, seq in enumerate(seqs):
            if self.holds(seq, node, fences[i] if fences else "") and seq not in exp_held:
                exp_held.append(seq)
            else:
                exp_skipped.append(seq)
        self.queue.sweep(self.now)
        held, skipped = self.queue.hold_for_ack(node, seqs, fences)
        assert (held, skipped) == (exp_held, exp_skipped)
        if commit_ok:
            self.topic.delete_seqs(held)
            for seq in held:
                del self.jobs[seq]
        else:
            self.queue.release_held(held)  # the delete failed: claimable again
            for seq in held:
                self.jobs[seq].state = "ready"

    @rule(node=NODES, data=st.data(), delay_ms=st.sampled_from([0, 0, 150, 600]))
    def nack(self, node: str, data: st.DataObject, delay_ms: int) -> None:
        seqs, fences = self.pick(data)
        self.model_sweep()
        done = 0
        exp_skipped: list[int] = []
        for i, seq in enumerate(seqs):
            if self.holds(seq, node, fences[i] if fences else ""):
                job = self.jobs[seq]
                done += 1
                if delay_ms:
                    job.state, job.ready_at = "delayed", self.now + delay_ms / 1000
                else:
                    job.state = "ready"
            else:
                exp_skipped.append(seq)
        self.queue.sweep(self.now)
        assert self.queue.nack(node, seqs, fences, delay_ms, self.now) == (done, exp_skipped)

    @rule(node=NODES, data=st.data(), lease_ms=LEASES)
    def extend(self, node: str, data: st.DataObject, lease_ms: int) -> None:
        seqs, fences = self.pick(data)
        self.model_sweep()
        exp: dict[int, int] = {}
        exp_skipped: list[int] = []
        for i, seq in enumerate(seqs):
            if self.holds(seq, node, fences[i] if fences else ""):
                self.jobs[seq].expires_at = self.now + lease_ms / 1000 + 0.001
                exp[seq] = self.now_ms + lease_ms
            else:
                exp_skipped.append(seq)
        self.queue.sweep(self.now)
        got = self.queue.extend(node, seqs, fences, lease_ms, self.now, self.now_ms)
        assert got == (exp, exp_skipped)

    @rule(data=st.data())
    def delete_records(self, data: st.DataObject) -> None:
        if not self.jobs:
            return
        doomed = data.draw(st.lists(st.sampled_from(sorted(self.jobs)), max_size=3))
        self.topic.delete_seqs(doomed)
        for seq in set(doomed):
            del self.jobs[seq]

    @rule(ms=st.sampled_from([1, 99, 100, 101, 150, 250, 251, 600, 1001]))
    def advance(self, ms: int) -> None:
        self.now_ms += ms

    # ---- agreement ----------------------------------------------------------------------

    @invariant()
    def counts_agree(self) -> None:
        self.model_sweep()
        self.queue.sweep(self.now)
        counts = self.queue.counts()
        states = [j.state for j in self.jobs.values()]
        assert counts.ready == states.count("ready")
        assert counts.in_flight == states.count("leased")
        assert counts.delayed == states.count("delayed")
        assert self.topic.count == len(self.jobs)
        assert set(self.queue.leases) == {s for s, j in self.jobs.items() if j.state == "leased"}
        for seq, lease in self.queue.leases.items():
            assert lease.node == self.jobs[seq].node
        for seq, job in self.jobs.items():
            assert self.queue.deliveries.get(seq, 0) == job.deliveries
        ready: dict[int, int] = {}
        for job in self.jobs.values():
            ready.setdefault(job.prio, 0)
            ready[job.prio] += job.state == "ready"
        top = sorted(ready, reverse=True)[:3]
        assert self.queue.ready_by_priority(3) == [(p, ready[p]) for p in top]


LeaseTableMachine.TestCase.settings = settings(
    max_examples=300, stateful_step_count=40, deadline=None
)
TestLeaseTable = LeaseTableMachine.TestCase
