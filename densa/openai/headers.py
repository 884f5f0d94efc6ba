"""The headers densa adds to the OpenAI API, read and written by the server and the router alike."""

SESSION_HEADER = "x-session-affinity"  # keeps a conversation on one worker (and its cached prefix)
IGNORED_FIELDS_HEADER = "x-densa-ignored-fields"  # fields dropped (unknown_fields.py)
