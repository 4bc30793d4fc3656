"""Unit tests of the sampler's records (``server.persistence.sequences``) and of provenance spans on the wire
and against the records (``server.serving.provenance``)."""

from __future__ import annotations

import numpy as np
import pytest
from tinker.proto import tinker_public_pb2 as pb

from hosted_tinker.core.errors import ApiError, WireError
from hosted_tinker.server.persistence.sequences import Sampled, SequenceRecords, _npy
from hosted_tinker.server.protocol.proto_codec import Span, WireDatum, decode_forward_backward
from hosted_tinker.server.serving import provenance

pytestmark = pytest.mark.fast


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_record_lives_a_day_from_its_last_use_and_only_for_its_session(tmp_path):
    clock = Clock()
    records = SequenceRecords(tmp_path / "db.sqlite", ttl_s=100.0, clock=clock)
    records.record("sess-a", "s:1", [1, 2, 3], [Sampled("s:1:0", [7, 8], [-0.5, -1.25]), Sampled("s:1:1", [9], [-2.0])])
    got = records.take("sess-a", ["s:1:0", "s:1:1", "nope"])
    assert set(got) == {"s:1:0", "s:1:1"}
    np.testing.assert_array_equal(got["s:1:0"].prompt, [1, 2, 3])
    np.testing.assert_array_equal(got["s:1:0"].tokens, [7, 8])
    assert got["s:1:0"].logprobs.dtype == np.float32 and list(got["s:1:0"].logprobs) == [-0.5, -1.25]
    assert records.take("sess-b", ["s:1:0"]) == {}  # another session's

    clock.now += 90
    assert set(records.take("sess-a", ["s:1:0"])) == {"s:1:0"}  # used: its day starts again
    clock.now += 90  # 180 s after sampling: s:1:1 (unused since t+0) is gone, s:1:0 is not
    assert set(records.take("sess-a", ["s:1:0", "s:1:1"])) == {"s:1:0"}
    assert records.delete_expired() == 1
    clock.now += 200
    assert records.delete_expired() == 1
    assert records._db.execute("SELECT count(*) FROM sampled_prompts").fetchone()[0] == 0  # noqa: SLF001
    records.close()


def test_a_request_may_name_more_sequences_than_a_statement_takes(tmp_path):
    records = SequenceRecords(tmp_path / "db.sqlite")
    records.record("s", "r:1", [1], [Sampled(f"r:1:{i}", [i], [-1.0]) for i in range(1200)])
    wanted = [f"r:1:{i}" for i in range(0, 1200, 2)] + [
        f"nope:{i}" for i in range(260_000)
    ]  # over this build's cap of 250,000
    got = records.take("s", wanted)
    assert len(got) == 600 and int(got["r:1:1198"].tokens[0]) == 1198


def test_records_survive_reopening(tmp_path):
    SequenceRecords(tmp_path / "db.sqlite").record("s", "x:1", [4], [Sampled("x:1:0", [5], [-0.1])])
    again = SequenceRecords(tmp_path / "db.sqlite")
    assert list(again.take("s", ["x:1:0"])["x:1:0"].tokens) == [5]


def _request(*, model_spans: list[pb.ProvenanceSpan], loss_spans: list[pb.ProvenanceSpan]) -> bytes:
    msg = pb.ForwardBackwardRequest(model_id="m", seq_id=1, loss_fn="cross_entropy")
    datum = msg.data.add()
    datum.model_input.add().encoded_text.tokens = np.array([1, 2], dtype="<i4").tobytes()
    datum.model_input_spans.extend(model_spans)
    datum.loss_fn_input_spans.extend(loss_spans)
    return msg.SerializeToString()


def _span(kind: str, sid: str, offset: int, length: int) -> pb.ProvenanceSpan:
    span = pb.ProvenanceSpan()
    arm = getattr(span, kind)
    arm.sequence_id, arm.offset, arm.length = sid, offset, length
    return span


def test_spans_are_decoded_and_checked_on_the_wire():
    body = _request(
        model_spans=[_span("prompt_tokens", "a", 0, 1), _span("sampled_tokens", "a", 0, 1)],
        loss_spans=[_span("sampled_tokens", "a", 0, 2)],
    )
    (datum,) = decode_forward_backward(body).datums()
    assert datum.model_input_spans == [Span(False, "a", 0, 1), Span(True, "a", 0, 1)]
    assert datum.loss_fn_input_spans == [Span(True, "a", 0, 2)]
    one_sided = _request(model_spans=[_span("prompt_tokens", "a", 0, 2)], loss_spans=[])
    with pytest.raises(WireError, match="provenance comes as a pair"):
        decode_forward_backward(one_sided).datums()
    empty = _request(model_spans=[pb.ProvenanceSpan()], loss_spans=[_span("prompt_tokens", "a", 0, 2)])
    with pytest.raises(WireError, match=r"model_input_spans\[0\]: an empty span"):
        decode_forward_backward(empty).datums()
    no_id = _request(model_spans=[_span("prompt_tokens", "", 0, 2)], loss_spans=[_span("prompt_tokens", "a", 0, 2)])
    with pytest.raises(WireError, match="sequence_id is empty"):
        decode_forward_backward(no_id).datums()


def test_resolution_marks_the_sampled_targets_with_the_recorded_logprobs(tmp_path):
    records = SequenceRecords(tmp_path / "db.sqlite")
    records.record("s", "r:1", [10, 11, 12], [Sampled("r:1:0", [20, 21, 22], [-0.25, -0.5, -0.75])])
    rec = records.take("s", ["r:1:0"])
    # rl_loop's layout: input = prompt + sampled[:-1]; targets = 2 placeholders + sampled
    datum = WireDatum(
        tokens=np.array([10, 11, 12, 20, 21]),
        loss_fn_inputs={"target_tokens": np.array([0, 0, 20, 21, 22])},
        model_input_spans=[Span(False, "r:1:0", 0, 3), Span(True, "r:1:0", 0, 2)],
        loss_fn_input_spans=[Span(False, "r:1:0", 1, 2), Span(True, "r:1:0", 0, 3)],
    )
    out = provenance.resolve(datum, "data[0]", rec)
    assert list(out.sampled_mask) == [0, 0, 1, 1, 1]
    assert list(out.logprobs) == [0, 0, -0.25, -0.5, -0.75]
    provenance.check_client_logprobs(np.array([9.0, 9.0, -0.25, -0.5, -0.75], dtype=np.float32), out, "data[0]")
    with pytest.raises(ApiError, match=r"logprobs\[3\] = -0.6"):
        provenance.check_client_logprobs(np.array([0, 0, -0.25, -0.6, -0.75], dtype=np.float32), out, "data[0]")
    # a sampled target that is not the recorded token
    datum.loss_fn_inputs["target_tokens"] = np.array([0, 0, 20, 99, 22])
    with pytest.raises(ApiError, match=r"loss_fn_input_spans\[1\]: position 3 holds token 99"):
        provenance.resolve(datum, "data[0]", rec)
    # runs that do not tile their field
    provenance.check_tiling(datum, "data[0]")
    datum.loss_fn_input_spans = [Span(True, "r:1:0", 0, 3)]
    with pytest.raises(ApiError, match=r"data\[0\].loss_fn_input_spans cover 3 positions; the field has 5"):
        provenance.check_tiling(datum, "data[0]")


def test_a_records_routing_is_kept_and_resolved_per_input_position(tmp_path):
    """A mixture-of-experts record's experts (prompt once, each sequence's own) come back per
    input position of an rl_loop datum; the last sampled token's (never fed) and a dense
    model's record have none."""
    prompt_routing = np.arange(3 * 2 * 2, dtype=np.int16).reshape(3, 2, 2)  # (P, layers, top_k)
    routing = 100 + np.arange(3 * 2 * 2, dtype=np.int16).reshape(3, 2, 2)
    routing[-1] = -1
    records = SequenceRecords(tmp_path / "db.sqlite")
    records.record(
        "s", "r:1", [10, 11, 12], [Sampled("r:1:0", [20, 21, 22], [-0.25, -0.5, -0.75], routing)], prompt_routing
    )
    records.record("s", "d:1", [10, 11, 12], [Sampled("d:1:0", [20, 21, 22], [-0.25, -0.5, -0.75])])  # a dense model's
    reopened = SequenceRecords(tmp_path / "db.sqlite")
    rec = reopened.take("s", ["r:1:0", "d:1:0"])
    assert rec["r:1:0"].routed and not rec["d:1:0"].routed
    # read apart, where the training request runs, run by run: only the rows a run names
    runs = [("r:1:0", False, 0, 3), ("r:1:0", True, 0, 3), ("r:1:0", True, 1, 2), ("d:1:0", True, 0, 3)]
    recorded = reopened.routing(rec, runs)
    assert set(recorded) == set(runs[:3])
    np.testing.assert_array_equal(recorded[runs[0]], prompt_routing)
    np.testing.assert_array_equal(recorded[runs[1]], routing)
    np.testing.assert_array_equal(recorded[runs[2]], routing[1:3])

    def rl_datum(sid: str) -> WireDatum:
        return WireDatum(
            tokens=np.array([10, 11, 12, 20, 21]),
            loss_fn_inputs={"target_tokens": np.array([0, 0, 20, 21, 22])},
            model_input_spans=[Span(False, sid, 0, 3), Span(True, sid, 0, 2)],
            loss_fn_input_spans=[Span(False, sid, 1, 2), Span(True, sid, 0, 3)],
        )

    def routing_of(sid: str) -> np.ndarray | None:
        resolved = provenance.resolve(rl_datum(sid), "data[0]", rec)
        return provenance.routing(
            resolved.routed, 5, reopened.routing(rec, provenance.routing_runs(resolved.routed)), "data[0]"
        )

    np.testing.assert_array_equal(routing_of("r:1:0"), np.concatenate([prompt_routing, routing[:2]]))
    assert routing_of("d:1:0") is None
    # a datum whose runs name sequences of two models' records cannot be given one routing
    records.record("s", "w:1", [10, 11, 12], [Sampled("w:1:0", [20, 21, 22], [-0.25] * 3, routing[:, :1])])
    mixed = rl_datum("r:1:0")
    mixed.model_input_spans = [Span(False, "r:1:0", 0, 3), Span(True, "w:1:0", 0, 2)]
    both = reopened.take("s", ["r:1:0", "w:1:0"])
    routed = provenance.resolve(mixed, "data[0]", both).routed
    with pytest.raises(ApiError, match=r"data\[0\].model_input_spans: the sequences it names were sampled from"):
        provenance.routing(routed, 5, reopened.routing(both, provenance.routing_runs(routed)), "data[0]")


def test_records_made_before_routing_was_kept_still_read(tmp_path):
    import sqlite3

    db = sqlite3.connect(tmp_path / "db.sqlite")  # the tables as the previous version made them
    db.executescript(
        "CREATE TABLE sampled_prompts (request_key TEXT PRIMARY KEY, prompt BLOB NOT NULL);"
        "CREATE TABLE sampled_sequences (sequence_id TEXT PRIMARY KEY, request_key TEXT NOT NULL, "
        "session_id TEXT NOT NULL, tokens BLOB NOT NULL, logprobs BLOB NOT NULL, expires_at REAL NOT NULL);"
    )
    db.execute("INSERT INTO sampled_prompts VALUES ('o:1', ?)", (np.array([4], "<i4").tobytes(),))
    db.execute(
        "INSERT INTO sampled_sequences VALUES ('o:1:0', 'o:1', 's', ?, ?, 1e12)",
        (np.array([5], "<i4").tobytes(), np.array([-0.1], "<f4").tobytes()),
    )
    db.commit()
    db.close()
    records = SequenceRecords(tmp_path / "db.sqlite")
    old = records.take("s", ["o:1:0"])["o:1:0"]
    assert (
        list(old.tokens) == [5]
        and not old.routed
        and records.routing(records.take("s", ["o:1:0"]), [("o:1:0", True, 0, 1)]) == {}
    )
    records.record("s", "n:1", [4], [Sampled("n:1:0", [5], [-0.1], np.zeros((1, 1, 1), np.int16))])
    assert records.take("s", ["n:1:0"])["n:1:0"].routed
    assert records.routing(records.take("s", ["n:1:0"]), [("n:1:0", True, 0, 1)])[("n:1:0", True, 0, 1)].shape == (
        1,
        1,
        1,
    )


def test_routing_recorded_on_another_model_is_refused_naming_the_datum():
    from hosted_tinker.core.types import Capabilities

    caps = Capabilities("peft", "Qwen3MoeForCausalLM", (), 64, 64, 100, routed_experts=8, replay_routing=(2, 2))
    provenance.check_routing(np.full((5, 2, 2), 7, np.int16), caps, "data[0]")
    for other in (np.zeros((5, 3, 2), np.int16), np.zeros((5, 2, 4), np.int16), np.full((5, 2, 2), 8, np.int16)):
        with pytest.raises(ApiError, match=r"data\[0\].model_input_spans name sequences sampled from another model"):
            provenance.check_routing(other, caps, "data[0]")
    dense = Capabilities("peft", "Qwen3ForCausalLM", (), 64, 64, 100)
    with pytest.raises(ApiError, match="another model"):
        provenance.check_routing(np.zeros((5, 2, 2), np.int16), dense, "data[1]")


def test_a_keys_routing_is_kept_up_to_its_record_bytes_then_records_keep_none(tmp_path):
    clock = Clock()
    records = SequenceRecords(tmp_path / "db.sqlite", ttl_s=100.0, clock=clock)
    routing = np.zeros((4, 2, 2), np.int16)

    def sample(key: str) -> bool:
        return records.record(
            "s",
            key,
            [1, 2, 3, 4],
            [Sampled(f"{key}:0", [5, 6, 7, 8], [-1.0] * 4, routing)],
            routing,
            owner="k",
            routing_limit=limit,
        )

    limit = None
    assert sample("a")
    (one,) = records._db.execute("SELECT routing_bytes FROM sampled_sequences").fetchone()  # noqa: SLF001
    limit = 2 * one  # room for one more request's routing, not two
    assert sample("b")
    assert not sample("c")  # over: recorded without routing
    got = records.take("s", ["b:0", "c:0"])
    assert got["b:0"].routed and not got["c:0"].routed
    assert set(records.routing(got, [("b:0", True, 0, 4), ("c:0", True, 0, 4)])) == {("b:0", True, 0, 4)}
    np.testing.assert_array_equal(got["c:0"].tokens, [5, 6, 7, 8])  # the record itself is kept
    assert records.record("s", "o", [1], [Sampled("o:0", [5], [-1.0], routing[:1])], owner="other", routing_limit=one)
    clock.now += 101  # a and b expire: their routing no longer counts
    assert sample("d")


def test_routing_recorded_on_another_model_is_not_replayed(tmp_path):
    routing = np.zeros((1, 2, 2), np.int16)
    SequenceRecords(tmp_path / "db.sqlite", model="m1").record(
        "s", "a", [1], [Sampled("a:0", [5], [-1.0], routing)], routing
    )
    same = SequenceRecords(tmp_path / "db.sqlite", model="m1")
    assert same.take("s", ["a:0"])["a:0"].routed
    runs = [("a:0", False, 0, 1), ("a:0", True, 0, 1)]
    assert set(same.routing(same.take("s", ["a:0"]), runs)) == set(runs)
    other = SequenceRecords(tmp_path / "db.sqlite", model="m2")
    again = other.take("s", ["a:0"])["a:0"]
    assert not again.routed and list(again.tokens) == [5] and other.routing(other.take("s", ["a:0"]), runs) == {}


def test_a_models_identity_is_its_path_config_and_weight_files(tmp_path):
    from hosted_tinker.server.persistence.sequences import model_identity

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"x" * 10)
    first = model_identity(str(tmp_path))
    assert model_identity(str(tmp_path)) == first
    (tmp_path / "model.safetensors").write_bytes(b"x" * 11)  # other weights, the same config
    assert model_identity(str(tmp_path)) != first
    assert model_identity("Qwen/Qwen3-30B-A3B") != model_identity("Qwen/Qwen3-30B-A3B-Base")


def test_a_run_reads_its_own_rows_of_a_routing_not_the_whole_record(tmp_path):
    """A key may keep gigabytes of routing: a request naming one token of a long record must not
    make the gateway read or hold the record, neither where the request is checked (``take``)
    nor where its routing is read. Measured in a process of its own (SQLite's memory
    is not Python's): its peak grows by far less than the record's 32 MB (SQL's ``substr`` of
    the blob, which loads the whole value: 33 MB; incremental blob reads: 2 MB)."""
    import subprocess
    import sys

    long = np.random.default_rng(0).integers(0, 128, (250_000, 8, 8), dtype=np.int16)  # 8 of 128 experts
    SequenceRecords(tmp_path / "db.sqlite").record(
        "s", "l", [1], [Sampled("l:0", [5] * 250_000, [-1.0] * 250_000, long)], long[:1]
    )
    script = (  # the peak resident size reset (Linux's clear_refs) just before the read, read after
        "import sys\n"
        "from hosted_tinker.server.persistence.sequences import SequenceRecords\n"
        "def kib(field):\n"
        "    return int(next(line for line in open('/proc/self/status') if line.startswith(field)).split()[1])\n"
        "records = SequenceRecords(sys.argv[1])\n"
        "open('/proc/self/clear_refs', 'w').write('5')\n"
        "before = kib('VmRSS:')\n"
        "runs = [('l:0', True, 123456, 2), ('l:0', True, 0, 0), ('l:0', False, 0, 1)]\n"
        "got = records.routing(records.take('s', ['l:0']), runs)\n"
        "print(kib('VmHWM:') - before)\n"
        "print(got[runs[0]].ravel().tolist(), sorted(map(str, got)))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "db.sqlite")], capture_output=True, text=True, check=True
    )
    grew_kib, rows = done.stdout.splitlines()
    assert int(grew_kib) < 8 * 1024, grew_kib
    names = sorted(map(str, [("l:0", True, 123_456, 2), ("l:0", False, 0, 1)]))  # the empty run read nothing
    assert rows == f"{long[123_456:123_458].ravel().tolist()} {names}"


def test_routing_kept_in_the_sequence_row_by_an_earlier_version_is_moved_out_and_still_read(tmp_path):
    """Stop 53's data directories kept a sequence's routing in its row, which every use of the
    sequence (its day restarted) rewrote whole: opened now, it is moved to its own table."""
    import sqlite3

    routing = np.arange(3 * 2 * 2, dtype=np.int16).reshape(3, 2, 2)
    db = sqlite3.connect(tmp_path / "db.sqlite")  # the tables as that version made them
    db.executescript(
        "CREATE TABLE sampled_prompts (request_key TEXT PRIMARY KEY, prompt BLOB NOT NULL, routing BLOB, "
        "routing_model TEXT);"
        "CREATE TABLE sampled_sequences (sequence_id TEXT PRIMARY KEY, request_key TEXT NOT NULL, "
        "session_id TEXT NOT NULL, tokens BLOB NOT NULL, logprobs BLOB NOT NULL, expires_at REAL NOT NULL, "
        "routing BLOB, owner TEXT NOT NULL DEFAULT '', routing_bytes INTEGER NOT NULL DEFAULT 0);"
    )
    db.execute("INSERT INTO sampled_prompts VALUES ('o:1', ?, NULL, '')", (np.array([4], "<i4").tobytes(),))
    db.execute(
        "INSERT INTO sampled_sequences VALUES ('o:1:0', 'o:1', 's', ?, ?, 1e12, ?, 'k', 0)",
        (np.array([5, 6, 7], "<i4").tobytes(), np.full(3, -0.1, "<f4").tobytes(), _npy(routing)),
    )
    db.commit()
    db.close()
    records = SequenceRecords(tmp_path / "db.sqlite")
    got = records.take("s", ["o:1:0"])
    assert got["o:1:0"].routed
    np.testing.assert_array_equal(records.routing(got, [("o:1:0", True, 1, 2)])[("o:1:0", True, 1, 2)], routing[1:])
    (left,) = records._db.execute("SELECT count(*) FROM sampled_sequences WHERE routing IS NOT NULL").fetchone()  # noqa: SLF001
    assert left == 0


def test_routing_is_read_only_from_the_rows_take_saw(tmp_path):
    """``take`` runs on the event loop, the routing read later on the dispatch thread: in between
    a sequence may be sampled again under its ``seq_id`` (its routing row deleted) and SQLite may
    give the freed row id to another key's record. The read must then find no routing (the datum
    trains unreplayed), never the other record's."""
    records = SequenceRecords(tmp_path / "db.sqlite")
    mine, theirs = np.full((3, 2, 2), 1, dtype=np.int16), np.full((3, 2, 2), 7, dtype=np.int16)
    records.record("s1", "a:1", [10, 11], [Sampled("a:1:0", [20, 21, 22], [-0.5] * 3, mine)], mine[:2])
    taken = records.take("s1", ["a:1:0"])
    sampled, prompt = ("a:1:0", True, 0, 3), ("a:1:0", False, 0, 2)
    np.testing.assert_array_equal(records.routing(taken, [sampled])[sampled], mine)

    # sampled again under the same seq_id, by a model that records none: its routing row goes,
    # and the next record, another key's, is given that row id
    records.record("s1", "a:2", [10, 11], [Sampled("a:1:0", [20, 21, 22], [-0.5] * 3)])
    records.record("s2", "b:1", [10, 11], [Sampled("b:1:0", [20, 21, 22], [-0.5] * 3, theirs)])
    assert records.take("s2", ["b:1:0"])["b:1:0"].rows[0] == taken["a:1:0"].rows[0]
    assert records.routing(taken, [sampled, prompt]) == {}

    # sampled again with routing: the same sequence id and, it may be, the same row id: another sample's
    records.record("s1", "a:3", [10, 11], [Sampled("a:1:0", [20, 21, 23], [-0.5] * 3, mine + 1)])
    again = records.take("s1", ["a:1:0"])
    assert records.routing(taken, [sampled]) == {}
    np.testing.assert_array_equal(records.routing(again, [sampled])[sampled], mine + 1)
