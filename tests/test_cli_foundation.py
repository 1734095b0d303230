from __future__ import annotations

import json


def test_caps_json_matches_design(cli):
    res = cli("caps", "--profile", "llama-7b@a800-80g", "--gpus", "32", "--json")
    assert res.returncode == 0, res.stderr
    caps = {row["config"]: row["cap_tokens"] for row in json.loads(res.stdout)["configs"]}
    assert caps["tp1pp2"] == 11264
    assert caps["tp2pp1"] == 21888
    assert caps["tp4pp1"] == 46080
    assert caps["tp8pp1"] == 85248


def test_unknown_preset_is_one_line_exit_2(cli):
    res = cli("caps", "--profile", "llama-9b@nowhere")
    assert res.returncode == 2
    assert "Traceback" not in res.stderr
    assert res.stderr.strip().count("\n") == 0
    assert "llama-9b" in res.stderr
