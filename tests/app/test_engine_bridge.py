"""The engine bridge's typed boundary: the chat settings become the engine's own SamplingParams
(every setting the app shows reaches it under the engine's field name), and settings the engine
refuses reach the user as an error instead of being replaced by defaults in silence."""

from __future__ import annotations

import dataclasses

import pytest
from minecart.app.engine_bridge import SETTING_TO_FIELD, sampling_params
from minecart.app.settings import default_settings
from minecart.engine.sampling import SamplingParams


def test_every_default_setting_names_a_sampling_field():
    fields = {f.name for f in dataclasses.fields(SamplingParams)}
    assert set(SETTING_TO_FIELD.values()) <= fields
    settings = default_settings()["sampling"]
    assert set(settings) <= set(SETTING_TO_FIELD)
    p = sampling_params({**settings, "seed": 11})
    for key, value in settings.items():
        if key != "seed":
            assert getattr(p, SETTING_TO_FIELD[key]) == value, key
    assert p.seed == 11


@pytest.mark.parametrize("settings, words", [({"top_p": 0.0}, "top_p"), ({"temperature": -1.0}, "temperature"),
                                             ({"max_new_tokens": 5}, "unknown sampling setting max_new_tokens")])
def test_unusable_settings_raise_a_readable_error(settings, words):
    with pytest.raises(ValueError, match=words):
        sampling_params(settings)



def test_bad_settings_reach_the_user_not_the_defaults(qtbot, make_bridge, scripted, tiny_model):
    model = scripted(reply="ok")
    params = []
    generate = model.generate

    def recording(prompt, params_=None, **kw):
        params.append(params_)
        return generate(prompt, params_, **kw)

    model.generate = recording
    bridge = make_bridge(model)
    with qtbot.waitSignal(bridge.loaded, timeout=10000):
        bridge.load(tiny_model)
    with qtbot.waitSignal(bridge.chat_error, timeout=5000) as sig:
        bridge.chat([{"role": "user", "content": "hi"}], {"top_p": 0.0})
    assert "top_p must be in (0, 1]" in sig.args[0] and params == []
    with qtbot.waitSignal(bridge.chat_done, timeout=5000):
        bridge.chat([{"role": "user", "content": "hi"}], {"repeat_penalty": 1.3, "max_tokens": 7})
    assert params[-1].repetition_penalty == 1.3 and params[-1].max_tokens == 7
