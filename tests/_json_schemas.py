"""A JSON Schema the fixture model's constrained answers are held to (CPU and GPU tests): enums and
booleans only, so even a random-weight model finishes an answer in a few dozen tokens."""

ANSWER = {
    "type": "object",
    "properties": {"kind": {"enum": ["cat", "dog", "bird"]}, "ok": {"type": "boolean"},
                   "legs": {"enum": [0, 2, 4]}, "note": {"type": ["null", "boolean"]}},
    "required": ["kind", "ok", "legs"],
    "additionalProperties": False,
}
