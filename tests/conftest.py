"""Top-level test configuration: the worker tests only run inside real multi-process jobs."""

import os

collect_ignore_glob = [] if os.environ.get("HVDPLUS_TEST_WORKER") else ["parallel/workers/*", "parallel/workers_tf/*"]
