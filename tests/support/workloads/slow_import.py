"""A module that takes 0.15 s to import (a lazy import in a request handler)."""

import time

time.sleep(0.15)
