"""DAPO's soft overlong penalty (exactrl/algorithms/overlong.py) against the paper's piecewise definition, written out
here once more at the band's every edge; and its application to a reward result."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from exactrl.algorithms.overlong import add_overlong_penalty, overlong_metrics, overlong_penalties


def _paper(n: int, l_max: int, l_cache: int) -> float:
    """DAPO eq. 13, as printed: 0 up to L_max - L_cache, ((L_max - L_cache) - |y|) / L_cache up to L_max, -1 beyond."""
    if n <= l_max - l_cache:
        return 0.0
    if n <= l_max:
        return ((l_max - l_cache) - n) / l_cache
    return -1.0


@pytest.mark.parametrize("l_max,l_cache", [(10, 4), (6, 1), (6, 5), (4096, 512)])
def test_penalty_is_the_papers_at_every_length(l_max, l_cache):
    lengths = list(range(0, l_max + 3))
    got = overlong_penalties(lengths, l_max, l_cache, penalty=1.0)
    assert got == pytest.approx([_paper(n, l_max, l_cache) for n in lengths], abs=1e-15)
    # The band's edges by hand: the last free length, the first penalised one, the limit itself.
    assert got[l_max - l_cache] == 0.0
    assert got[l_max - l_cache + 1] == pytest.approx(-1.0 / l_cache)
    assert got[l_max] == -1.0


def test_penalty_factor_scales_it():
    assert overlong_penalties([8, 10], 10, 4, penalty=0.5) == pytest.approx([-0.25, -0.5])


def test_band_must_fit_before_the_limit():
    for bad in (0, 10, 11):
        with pytest.raises(ValueError, match="buffer_tokens"):
            overlong_penalties([1], 10, bad)


def test_added_to_the_reward_kept_out_of_the_verdict():
    res = SimpleNamespace(
        rewards=[1.0, 0.0, 1.0], per_function={"numeric_match": [1.0, 0.0, 1.0]}, correct=[True, False, True]
    )
    add_overlong_penalty(res, [3, 9, 10], max_tokens=10, buffer_tokens=2, penalty=1.0)
    assert res.rewards == pytest.approx([1.0, -0.5, 0.0])
    assert res.per_function["overlong_penalty"] == pytest.approx([0.0, -0.5, -1.0])
    assert res.correct == [True, False, True]  # a right answer that ran long is still right
    assert overlong_metrics(res.per_function) == {"overlong/penalized_samples": 2.0}
    assert overlong_metrics({"numeric_match": [1.0]}) == {}
    with pytest.raises(ValueError, match="lengths"):
        add_overlong_penalty(res, [1], 10, 2, 1.0)
