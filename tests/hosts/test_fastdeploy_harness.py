"""The host harness itself: a scenario runs in a child process against FastDeploy's real code."""

from __future__ import annotations

from _fastdeploy_host import DEFAULT_STAND_INS, host_or_skip, run_scenario


def test_scenario_imports_the_real_fastdeploy_and_lists_stand_ins(capsys):
    host = host_or_skip()
    result = run_scenario(
        """
        import os
        import fastdeploy
        report(file=fastdeploy.__file__, plugins=os.environ.get("FD_PLUGINS"))
        """,
        host=host,
    ).check()
    if host.path:
        assert result.data["file"].startswith(host.path)
    assert result.data["plugins"] is None  # the parent's FD_PLUGINS never leaks in
    assert set(result.stand_ins_offered) <= set(DEFAULT_STAND_INS)
    out = capsys.readouterr().out
    assert "stand-in modules offered" in out and "imported by the scenario" in out
