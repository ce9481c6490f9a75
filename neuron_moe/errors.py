"""The one exception type the CLI turns into a clean `error: ...` line (exit 2).

Anything a user can get wrong — a port file, a checkpoint, a flag — raises a subclass with a
message that names the problem. Anything else is a bug and keeps its traceback.
"""


class UserError(Exception):
    pass
