"""Constraints the structured-output tests generate with (JSON schemas, regexes, choices,
grammars). Every schema bounds its output (maxLength, maxItems, ranges, no extra properties) so
that a random tiny model finishes well within max_tokens; the validity check is then 100 %."""

from __future__ import annotations

import json
import os

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

with open(os.path.join(_ROOT, "benchmarks", "schemas", "employee_profile.json")) as f:
    EMPLOYEE_PROFILE = json.load(f)

# Dotted-quad IPv4, each octet 0-255 without leading zeros.
IPV4_REGEX = r"((25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)\.){3}(25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"


def _s(n: int = 12, **kw) -> dict:
    return {"type": "string", "maxLength": n, **kw}


def _obj(props: dict, required: list[str] | None = None, **kw) -> dict:
    return {"type": "object", "properties": props,
            "required": list(props) if required is None else required,
            "additionalProperties": False, **kw}


SCHEMAS: dict[str, dict] = {
    "employee_profile": EMPLOYEE_PROFILE,
    "string": _s(),
    "string_min_max": _s(8, minLength=3),
    "integer": {"type": "integer", "minimum": -50, "maximum": 50},
    "integer_exclusive": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 1000},
    "number_range": {"type": "number", "minimum": 0, "maximum": 1},
    "boolean": {"type": "boolean"},
    "null": {"type": "null"},
    "enum_str": {"enum": ["red", "green", "blue"]},
    "enum_mixed": {"enum": ["a", 1, True, None]},
    "const": {"const": "fixed value"},
    "flat_object": _obj({"name": _s(), "age": {"type": "integer", "minimum": 0,
                                                "maximum": 120}}),
    "optional_props": _obj({"a": _s(5), "b": {"type": "boolean"}, "c": _s(5)}, ["a"]),
    "no_required": _obj({"x": {"type": "integer", "minimum": 0, "maximum": 9}}, []),
    "nested_object": _obj({"user": _obj({"id": {"type": "integer", "minimum": 1,
                                                 "maximum": 9999}, "name": _s(10)}),
                           "active": {"type": "boolean"}}),
    "deep_nesting": _obj({"a": _obj({"b": _obj({"c": _obj({"d": _s(4)})})})}),
    "array_strings": {"type": "array", "items": _s(6), "minItems": 1, "maxItems": 4},
    "array_ints_exact": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                    "maximum": 99},
                         "minItems": 3, "maxItems": 3},
    "array_objects": {"type": "array", "maxItems": 3,
                      "items": _obj({"k": _s(5), "v": {"type": "integer", "minimum": 0,
                                                       "maximum": 100}})},
    "array_empty_ok": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
    "tuple_prefix_items": {"type": "array", "prefixItems": [_s(5), {"type": "integer",
                                                                    "minimum": 0,
                                                                    "maximum": 10}],
                           "items": False},
    "any_of": {"anyOf": [_s(6), {"type": "integer", "minimum": 0, "maximum": 10}]},
    "any_of_objects": {"anyOf": [_obj({"cat": _s(5)}), _obj({"dog": {"type": "integer",
                                                                      "minimum": 0,
                                                                      "maximum": 5}})]},
    "nullable": _obj({"v": {"type": ["string", "null"], "maxLength": 6}}),
    "type_union": {"type": ["integer", "boolean"], "minimum": 0, "maximum": 3},
    "ref_defs": {"$defs": {"point": _obj({"x": {"type": "integer", "minimum": -9,
                                                 "maximum": 9},
                                           "y": {"type": "integer", "minimum": -9,
                                                 "maximum": 9}})},
                 **_obj({"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}})},
    "definitions_ref": {"definitions": {"tag": _s(4)},
                        "type": "array", "items": {"$ref": "#/definitions/tag"},
                        "maxItems": 3},
    "all_of": {"allOf": [_obj({"a": _s(3), "b": _s(3)}, ["a"]),
                         {"required": ["b"]}]},
    "pattern_digits": _s(10, pattern=r"^\d{3}-\d{4}$"),
    "pattern_word": _s(12, pattern=r"^\w{2,8}$"),
    "pattern_date": _s(10, pattern=r"^20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])$"),
    "pattern_hex_color": _s(7, pattern="^#[0-9a-fA-F]{6}$"),
    "enum_in_object": _obj({"status": {"enum": ["open", "closed", "pending"]},
                            "priority": {"type": "integer", "minimum": 1, "maximum": 5}}),
    "const_in_object": _obj({"version": {"const": 2}, "kind": {"const": "event"},
                             "payload": _s(8)}),
    "array_of_arrays": {"type": "array", "maxItems": 2,
                        "items": {"type": "array", "maxItems": 2,
                                  "items": {"type": "integer", "minimum": 0, "maximum": 9}}},
    "unique_free_list": _obj({"ids": {"type": "array", "maxItems": 3,
                                      "items": {"type": "integer", "minimum": 0,
                                                "maximum": 999}}}),
    "many_props": _obj({f"f{i}": {"type": "integer", "minimum": 0, "maximum": 9}
                        for i in range(12)}),
    "unicode_keys": _obj({"名前": _s(6), "città": _s(6)}),
    "escaped_key_names": _obj({"a\"b": _s(3), "c\\d": {"type": "boolean"}}),
    "order_line": _obj({"sku": _s(8, pattern="^[A-Z]{3}-[0-9]{3}$"),
                        "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                        "price": {"type": "number", "minimum": 0, "maximum": 1000},
                        "gift": {"type": "boolean"}}),
    "recipe": _obj({"title": _s(20), "servings": {"type": "integer", "minimum": 1,
                                                   "maximum": 12},
                    "ingredients": {"type": "array", "minItems": 1, "maxItems": 4,
                                    "items": _obj({"item": _s(10),
                                                   "grams": {"type": "integer", "minimum": 1,
                                                             "maximum": 1000}})},
                    "vegan": {"type": "boolean"}}),
    "event": _obj({"name": _s(15), "date": _s(10, pattern=r"^\d{4}-\d{2}-\d{2}$"),
                   "attendees": {"type": "array", "maxItems": 3, "items": _s(8)},
                   "location": {"anyOf": [{"type": "null"}, _obj({"city": _s(10)})]}}),
    "ipv4_field": _obj({"host": _s(15, pattern="^" + IPV4_REGEX + "$"),
                        "port": {"type": "integer", "minimum": 1, "maximum": 65535}}),
    "sentiment": _obj({"label": {"enum": ["positive", "negative", "neutral"]},
                       "score": {"type": "number", "minimum": 0, "maximum": 1}}),
}

REGEXES: dict[str, str] = {
    "ipv4": IPV4_REGEX,
    "phone": r"\(\d{3}\) \d{3}-\d{4}",
    "word_list": r"\w{1,6}(, \w{1,6}){0,3}",
    "yes_no": r"(yes|no)",
    "iso_date": r"20\d\d-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])",
    "email": r"[a-z]{1,10}@[a-z]{1,8}\.(com|org)",
}

CHOICES = [["positive", "negative", "neutral"], ["A", "B", "C", "D"], ["是", "否"]]

GRAMMARS = {
    # Lark (llguidance's dialect) and GBNF (llama.cpp's).
    "lark_arith": 'start: expr\nexpr: NUM | NUM OP expr\nNUM: /[0-9]{1,3}/\nOP: "+" | "-" | "*"',
    "gbnf_greeting": 'root ::= ("hello" | "hi") " " name\nname ::= [a-z]{1,8}',
}


# ------------------------------------------------------------------ real-world pydantic schemas
# Schemas as applications send them: ``Model.model_json_schema()`` of pydantic models, with the
# keywords llguidance cannot enforce that pydantic writes on its own (``uniqueItems`` for sets,
# a look-around ``pattern`` for every Decimal, ``propertyNames`` for constrained dict keys). Lengths are bounded so that a random tiny model
# finishes. ``PYDANTIC_IGNORED``: what a lenient (non-strict) request ignores for each.

def _pydantic_models() -> dict:
    import datetime
    import enum
    import uuid
    from decimal import Decimal
    from typing import Annotated, Literal, Optional, Union

    from pydantic import BaseModel as _Base
    from pydantic import ConfigDict, Field, conint, constr

    class BaseModel(_Base):
        # No extra properties (as structured-output apps and OpenAI's strict mode use them):
        # otherwise a random model may write unbounded extra keys.
        model_config = ConfigDict(extra="forbid")

    class Color(str, enum.Enum):
        red = "red"
        green = "green"
        blue = "blue"

    class Address(BaseModel):
        street: constr(max_length=12)
        zip_code: constr(pattern=r"^\d{5}$")

    class Cat(BaseModel):
        kind: Literal["cat"]
        lives: conint(ge=0, le=9)

    class Dog(BaseModel):
        kind: Literal["dog"]
        good: bool

    class TaggedItem(BaseModel):  # sets: uniqueItems
        name: constr(max_length=8)
        tags: set[constr(max_length=5)] = Field(max_length=3)
        ids: frozenset[conint(ge=0, le=99)] = Field(max_length=3)

    class Customer(BaseModel):  # Optional, nested model, enum
        name: constr(min_length=1, max_length=10)
        age: Optional[conint(ge=0, le=120)] = None
        favourite: Color
        address: Address

    class Owner(BaseModel):  # a discriminated union
        owner: constr(max_length=8)
        pet: Annotated[Union[Cat, Dog], Field(discriminator="kind")]

    class Invoice(BaseModel):  # Decimal (look-around pattern), date, uuid, tuple
        id: uuid.UUID
        issued: datetime.date
        total: Decimal
        lines: list[tuple[constr(max_length=6), conint(ge=1, le=9)]] = Field(max_length=2)

    class Settings(BaseModel):  # constrained dict keys: propertyNames
        flags: dict[constr(max_length=4), bool] = Field(max_length=2)

    class Survey(BaseModel):  # conint / confloat bounds, multipleOf, Literal choices
        score: conint(ge=1, le=5)
        weight: float = Field(ge=0, le=1, multiple_of=0.25)
        answer: Literal["yes", "no", "maybe"]
        comments: list[constr(max_length=6)] = Field(default_factory=list, max_length=2)

    return {m.__name__: m for m in (TaggedItem, Customer, Owner, Invoice, Survey, Settings)}


PYDANTIC_MODELS = _pydantic_models()
PYDANTIC_SCHEMAS = {name: m.model_json_schema() for name, m in PYDANTIC_MODELS.items()}
PYDANTIC_IGNORED = {"TaggedItem": ["uniqueItems"], "Customer": [], "Owner": [],
                    "Invoice": ["pattern"], "Survey": [], "Settings": ["propertyNames"]}
# Unbounded once their ignored keywords are gone (dict keys of any length): not generated with.
PYDANTIC_UNBOUNDED = {"Settings"}

# One schema per keyword llguidance cannot enforce -> the names a lenient request reports.
UNENFORCEABLE = {
    "uniqueItems": ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True,
                     "maxItems": 3}, ["uniqueItems"]),
    "contains": ({"type": "array", "contains": {"const": 1}, "maxItems": 3}, ["contains"]),
    "if/then/else": ({"type": "object", "if": {"properties": {"a": {"const": 1}}},
                      "then": {"required": ["b"]}, "else": {"required": ["c"]}},
                     ["else", "if", "then"]),
    "dependentSchemas": ({"type": "object", "dependentSchemas": {"a": {"required": ["b"]}}},
                         ["dependentSchemas"]),
    "dependentRequired": ({"type": "object", "dependentRequired": {"a": ["b"]}},
                          ["dependentRequired"]),
    "not": ({"type": "integer", "not": {"const": 3}}, ["not"]),
    "propertyNames": ({"type": "object", "propertyNames": {"maxLength": 3}}, ["propertyNames"]),
    "unevaluatedProperties": ({"type": "object", "unevaluatedProperties": False},
                              ["unevaluatedProperties"]),
    "format": ({"type": "string", "format": "phone-number", "maxLength": 8},
               ["format: phone-number"]),
    "pattern": ({"type": "string", "pattern": "^(?!x)[a-z]{1,4}$"}, ["pattern"]),
    "patternProperties": ({"type": "object", "patternProperties": {"(a)\\1": {"type": "null"}},
                           "additionalProperties": False}, ["patternProperties"]),
}
