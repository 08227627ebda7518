"""JSON schemas of the shapes applications send, and prompts to fill them: shared by
tests/test_structured.py and benchmarks/structured.py (no pytest here)."""

from __future__ import annotations

from typing import Any

_S = {"type": "string", "maxLength": 24}
SCHEMAS: list[dict[str, Any]] = [
    {  # flat, required, closed
        "type": "object",
        "properties": {"name": _S, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {  # an enum and a boolean
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "bright": {"type": "boolean"},
        },
        "required": ["color", "bright"],
        "additionalProperties": False,
    },
    {  # a bounded array of strings
        "type": "object",
        "properties": {"items": {"type": "array", "items": _S, "minItems": 1, "maxItems": 3}},
        "required": ["items"],
        "additionalProperties": False,
    },
    {  # nested objects
        "type": "object",
        "properties": {
            "city": {
                "type": "object",
                "properties": {"name": _S, "country": _S},
                "required": ["name", "country"],
                "additionalProperties": False,
            }
        },
        "required": ["city"],
        "additionalProperties": False,
    },
    {  # a number and a nullable field
        "type": "object",
        "properties": {
            "price": {"type": "number", "minimum": 0, "maximum": 1000},
            "note": {"type": ["string", "null"], "maxLength": 24},
        },
        "required": ["price", "note"],
        "additionalProperties": False,
    },
    {  # an array of objects
        "type": "object",
        "properties": {
            "people": {
                "type": "array",
                "maxItems": 2,
                "items": {
                    "type": "object",
                    "properties": {"first": _S, "last": _S},
                    "required": ["first", "last"],
                    "additionalProperties": False,
                },
            }
        },
        "required": ["people"],
        "additionalProperties": False,
    },
    {  # a top-level array of integers
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": 100},
        "minItems": 2,
        "maxItems": 4,
    },
    {  # a pattern-constrained string
        "type": "object",
        "properties": {"date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}},
        "required": ["date"],
        "additionalProperties": False,
    },
    {  # an enum of integers and a const
        "type": "object",
        "properties": {"stars": {"enum": [1, 2, 3, 4, 5]}, "kind": {"const": "review"}},
        "required": ["stars", "kind"],
        "additionalProperties": False,
    },
    {  # anyOf
        "type": "object",
        "properties": {"answer": {"anyOf": [{"type": "integer"}, {"enum": ["unknown"]}]}},
        "required": ["answer"],
        "additionalProperties": False,
    },
]
PROMPTS = [
    "Describe a person as JSON.",
    "Give me data about the city of Paris as JSON.",
]
# More prompts for the benchmark's 200 requests (20 prompts x 10 schemas).
MORE_PROMPTS = [
    "Describe a person as JSON.",
    "Give me data about the city of Paris as JSON.",
    "Tell me about a book you like, as JSON.",
    "Describe a car as JSON.",
    "Give me a recipe as JSON.",
    "Describe the weather today as JSON.",
    "Tell me about a planet as JSON.",
    "Describe a movie as JSON.",
    "Give me facts about a dog as JSON.",
    "Describe a house as JSON.",
    "Give me data about Tokyo as JSON.",
    "Describe a football match as JSON.",
    "Tell me about a painter as JSON.",
    "Describe a computer as JSON.",
    "Give me a shopping list as JSON.",
    "Describe a river as JSON.",
    "Tell me about a song as JSON.",
    "Describe a school as JSON.",
    "Give me data about a mountain as JSON.",
    "Describe a restaurant as JSON.",
]

# A pathological schema: 20 anyOf alternatives of 40 pattern properties, about 8 s to compile
# for the default model's tokenizer (measured): what the edge's compile-time bound is for.
SLOW_SCHEMA: dict[str, Any] = {
    "anyOf": [
        {
            "type": "object",
            "properties": {
                f"p{i}": {"type": "string", "pattern": "[a-z]{1,500}"} for i in range(40)
            },
        }
        for _ in range(20)
    ]
}
