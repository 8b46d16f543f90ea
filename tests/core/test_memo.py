"""The one bounded plan memo (domainflow.memo): bounded, keeps what is used, computes each key once."""

from domainflow.memo import Memo, memoized


def test_memo_stays_bounded_and_keeps_entries_in_use():
    memo = Memo(8, "test")
    for step in range(100):
        for key in ("hot a", "hot b"):
            memo.cached(key, lambda: key.upper())
        memo.put(("new", step), step)  # one new key every step
        assert len(memo) <= 8
    assert memo.get("hot a") == "HOT A" and "hot b" in memo
    assert ("new", 0) not in memo and memo.get(("new", 99)) == 99


def test_memo_computes_a_key_once_and_forgets_on_clear():
    calls = []
    memo = Memo(4, "test")

    @memoized(memo)
    def double(x):
        calls.append(x)
        return 2 * x

    assert [double(3), double(3), double(4), double(3)] == [6, 6, 8, 6] and calls == [3, 4]
    memo.clear()
    assert double(3) == 6 and calls == [3, 4, 3] and len(memo) == 1
    assert memo.get("missing", "default") == "default"
