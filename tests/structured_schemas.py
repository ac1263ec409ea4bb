"""Real-world JSON schemas of the kinds extraction, classification and agent code send: nested objects, arrays,
enums, anyOf, $ref, string formats and patterns, numbers with bounds. Used by tests/test_structured.py and
benchmarks/structured.py, each with the prompt that asks for it."""
PERSON = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 130},
    "email": {"type": "string", "format": "email"},
    "address": {"type": "object", "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                                  "country": {"enum": ["FR", "DE", "US", "GB"]}},
                "required": ["city", "country"], "additionalProperties": False}},
    "required": ["name", "age", "address"], "additionalProperties": False}
ORDER = {"type": "object", "$defs": {"item": {"type": "object", "properties": {
    "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
    "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
    "price": {"type": "number", "exclusiveMinimum": 0, "maximum": 10000}}, "required": ["sku", "quantity", "price"],
    "additionalProperties": False}},
    "properties": {"order_id": {"type": "string", "format": "uuid"}, "placed": {"type": "string", "format": "date"},
                   "items": {"type": "array", "items": {"$ref": "#/$defs/item"}, "minItems": 1, "maxItems": 3},
                   "note": {"anyOf": [{"type": "string", "maxLength": 40}, {"type": "null"}]}},
    "required": ["order_id", "placed", "items", "note"], "additionalProperties": False}
CLASSIFY = {"type": "object", "properties": {"label": {"enum": ["positive", "negative", "neutral"]},
                                             "confidence": {"type": "number", "minimum": 0, "maximum": 1}},
            "required": ["label", "confidence"], "additionalProperties": False}
EVENT = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 60}, "start": {"type": "string", "format": "date-time"},
    "attendees": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 4},
    "recurring": {"type": "boolean"}, "priority": {"type": "integer", "enum": [1, 2, 3]}},
    "required": ["title", "start", "attendees", "recurring", "priority"], "additionalProperties": False}

# name -> (the user's question, the schema its reply must match)
REAL_WORLD = {
    "person": ("Extract the person: Marie Curie, 66, lives in Paris, France. Email marie@curie.fr", PERSON),
    "order": ("Make up an order of two items.", ORDER),
    "classify": ("Classify the sentiment: I love this phone!", CLASSIFY),
    "event": ("Create a calendar event for a team meeting next Monday at 10am with Ann and Bob.", EVENT),
}
