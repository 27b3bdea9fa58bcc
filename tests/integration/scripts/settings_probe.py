"""Prints the hvdplus settings a worker sees (no init: settings only), as one JSON line."""

import dataclasses
import json

from hvdplus.common.settings import Settings

settings = Settings.from_env()
values = {k: v for k, v in dataclasses.asdict(settings).items() if k != "launch"}
print(json.dumps({"rank": settings.launch.rank, **values}, default=sorted), flush=True)  # explicit: a set
