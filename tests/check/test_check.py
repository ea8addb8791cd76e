"""`ortspec check`: the pure-Python chi-squared p-value against scipy, the checks on a tiny
export (passing, and failing when the decoder or the sampler is broken on purpose), errors as
one line with status 2, and (slow) the real default model.
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy import special, stats

from ortspec.runtime.check import checks as check
from ortspec.runtime.cli import check as check_cli
from ortspec.runtime.check.checks import run_checks
from ortspec.runtime.check.stats import chi2_sf, chi_squared_test, regularized_gamma_q
from ortspec.runtime.load import load_model
from ortspec.runtime.decoding.sampling import sample_from

# -- the p-value without scipy ---------------------------------------------------------------------

DFS = [1, 2, 3, 4, 7, 10, 31, 100, 315, 1000, 4999, 20000]


@pytest.mark.parametrize("df", DFS)
def test_chi2_sf_matches_scipy(df):
    xs = np.concatenate([[0.0, 1e-9, 0.01, 0.3], df * np.linspace(0.2, 3.0, 29), [df - 1, df + 1,
                                                                                  df + 2]])
    for x in xs:
        ours, theirs = chi2_sf(float(x), df), float(stats.chi2.sf(x, df))
        assert ours == pytest.approx(theirs, rel=1e-9, abs=1e-300), (df, x)
    assert chi2_sf(1e9, df) == 0.0 and chi2_sf(0.0, df) == 1.0


def test_regularized_gamma_q_matches_scipy_for_non_integer_shapes():
    rng = np.random.default_rng(0)
    for a, x in zip(rng.uniform(0.01, 500, 400), rng.uniform(0, 800, 400)):
        assert regularized_gamma_q(float(a), float(x)) == pytest.approx(
            float(special.gammaincc(a, x)), rel=1e-9, abs=1e-300)
    # both branches meet at x = a + 1 without a jump
    for a in (0.5, 3.0, 77.7, 2500.0):
        below, above = regularized_gamma_q(a, a + 1 - 1e-9), regularized_gamma_q(a, a + 1 + 1e-9)
        assert below == pytest.approx(above, rel=1e-7)


@pytest.mark.parametrize("a, x", [(0.0, 1.0), (-1.0, 1.0), (float("nan"), 1.0), (1.0, -0.5),
                                  (1.0, float("nan"))])
def test_regularized_gamma_q_domain(a, x):
    with pytest.raises(ValueError):
        regularized_gamma_q(a, x)


def test_chi_squared_test_pools_like_the_test_helpers_and_matches_scipy():
    rng = np.random.default_rng(1)
    p = rng.dirichlet(np.full(300, 0.2))  # many tiny cells: pooling matters
    counts = np.bincount(rng.choice(p.size, size=20_000, p=p), minlength=p.size)
    res = chi_squared_test(counts, p)
    exp = 20_000 * p
    small = exp < 5
    e = np.append(exp[~small], exp[small].sum())
    o = np.append(counts[~small], counts[small].sum())
    ref = stats.chisquare(o, e)
    assert res.cells == e.size and res.df == e.size - 1
    assert res.statistic == pytest.approx(ref.statistic, rel=1e-10)
    assert res.p_value == pytest.approx(ref.pvalue, rel=1e-8)
    assert res.outside_support == 0


def test_chi_squared_test_rejects_the_wrong_distribution_and_impossible_draws():
    rng = np.random.default_rng(2)
    p = np.array([0.5, 0.3, 0.15, 0.05, 0.0])
    wrong = np.array([0.45, 0.3, 0.15, 0.1, 0.0])
    counts = np.bincount(rng.choice(5, size=20_000, p=wrong), minlength=5)
    assert chi_squared_test(counts, p).p_value < 1e-6
    counts = np.bincount(rng.choice(5, size=20_000, p=p), minlength=5)
    assert chi_squared_test(counts, p).p_value > 1e-3
    counts[4] = 1  # one draw of a probability-0 token fails the test whatever the rest
    res = chi_squared_test(counts, p)
    assert res.outside_support == 1 and res.p_value == 0.0


# -- the checks on a tiny export ---------------------------------------------------------------------


TINY_EXPORT = {"seed": 5, "capacity": 96, "max_verify_len": 6}  # the tiny_dir fixture


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return load_model(tiny_dir)


def test_check_passes_on_a_validated_tiny_export(tiny_dir, capsys):
    rc = check_cli.main(["--model", str(tiny_dir), "--draws", "4000"])
    out, err = capsys.readouterr()
    assert rc == 0, out + err
    assert "12/12 checks passed" in out
    assert sum(line.endswith(" pass") for line in out.splitlines()) == 12 and "FAIL" not in out
    for row in ("verify vs step logits", "row invariance (blocks 1,2,3,4,6)",
                "greedy identity, prompt 4", "sampler, position",
                "point mass on token", "q = temperature 1.6"):
        assert row in out


def test_a_drifting_verify_entry_point_fails_the_first_check(tiny, monkeypatch):
    real = tiny.decoder.forward_batch
    monkeypatch.setattr(tiny.decoder, "forward_batch", lambda tokens: real(tokens) + 1e-3)
    row = check.check_verify_vs_step(tiny)
    assert not row.passed and "max |diff| 1.00e-03" in row.figure


def test_a_drifting_verify_row_fails_the_row_invariance_check(tiny, monkeypatch):
    real = tiny.decoder.forward_batch
    monkeypatch.setattr(tiny.decoder, "forward_batch", lambda tokens: real(tokens) + 1e-3)
    row = check.check_row_invariance(tiny)
    assert not row.passed and "max |diff| 1.00e-03" in row.figure


def test_a_verify_that_changes_the_argmax_fails_greedy_identity(tiny, monkeypatch):
    real = tiny.decoder.forward_batch

    def skewed(tokens):  # verify calls (not the 1-token ones) favour token 7 past their first row
        out = real(tokens)
        if len(tokens) > 1:
            out[1:, 7] += 1e3
        return out

    monkeypatch.setattr(tiny.decoder, "forward_batch", skewed)
    rows = check.check_greedy_identity(tiny, new_tokens=24)
    assert not all(r.passed for r in rows)
    assert any("first difference at token" in r.figure for r in rows)


def test_a_biased_rule_fails_the_sampler_check(tiny, monkeypatch):
    """The classic bug: on a rejection, draw from p_target instead of the residual. The output
    is then not distributed as p, and the chi-squared test sees it."""
    def biased(p_target, draft, token, rng):
        q = draft.prob(token)
        if rng.random() < min(1.0, float(p_target[token]) / q):
            return token, True
        return sample_from(p_target, rng), False

    monkeypatch.setattr(check, "accept_or_resample", biased)
    rows = check.check_sampler(tiny, draws=20_000, seed=0)
    point_rows = [r for r in rows if "point mass" in r.name]
    assert point_rows and not any(r.passed for r in point_rows), [r.figure for r in rows]


def test_the_table_names_every_check(tiny):
    rows = run_checks(tiny, draws=500, new_tokens=8)
    table = check.format_table(rows)
    lines = table.splitlines()
    assert lines[0].split()[:2] == ["check", "figure"] and set(lines[1]) <= {"-", " "}
    assert len(lines) == len(rows) + 2


# -- errors: one line, status 2 ------------------------------------------------------------------


def _one_line_error(capsys, argv) -> str:
    rc = check_cli.main(argv)
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("ortspec: error: "), (rc, out, err)
    return lines[0]


def test_bad_model_dir_provider_or_option_is_one_line(capsys, tmp_path, tiny_dir):
    assert "does not exist" in _one_line_error(capsys, ["--model", str(tmp_path / "none")])
    assert "has no manifest.json" in _one_line_error(capsys, ["--model", str(tmp_path)])
    line = _one_line_error(capsys, ["--model", str(tiny_dir), "--providers", "NoSuchExecutionProvider"])
    assert "'NoSuchExecutionProvider' is not available" in line
    assert "--draws must be >= 100" in _one_line_error(capsys, ["--model", str(tiny_dir), "--draws", "5"])
    assert "--alpha must be in (0, 1)" in _one_line_error(capsys, ["--alpha", "1.5"])
    assert "invalid int value" in _one_line_error(capsys, ["--draws", "many"])
    assert "unrecognized arguments" in _one_line_error(capsys, ["--frobnicate"])


def test_the_cli_dispatches_to_check(capsys, tmp_path):
    from ortspec.runtime.cli.main import main

    rc = main(["check", "--model", str(tmp_path / "none")])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("ortspec: error: ") and len(err.strip().splitlines()) == 1


# -- the real default model ----------------------------------------------------------------------


@pytest.mark.slow
def test_check_passes_on_the_default_model(capsys):
    """The full check, as a user runs it: verify vs step within 1e-4, greedy identity on four
    prompts, six chi-squared tests at N = 20,000 (about 40 s on 2 CPU cores)."""
    pytest.importorskip("onnx", reason="the export extra makes the default model")
    from ortspec import export
    path = export.ensure_default_model("fp32", progress=False)
    rc = check_cli.main(["--model", str(path)])
    out, err = capsys.readouterr()
    print(out)
    assert rc == 0, out + err
    assert "12/12 checks passed" in out
