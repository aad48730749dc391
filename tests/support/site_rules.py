"""Site OOM rule files for tests: one valid (its examples pass) and one whose condition does
not parse (line 8), as an operator would drop them in a rules directory."""

from __future__ import annotations

SITE_RULE = '''engine_version = "1.0"

[[rule]]
id = "site.bigger-than-device"
version = 1
class = "capacity"
priority = 5
condition = "R > T"
remedy = "This request can never fit on this device: shard the model or use a larger device."

[[rule.examples]]
kind = "positive"
numbers = { R = "20 GiB", T = "12 GiB", F = 0, A = 0, P = 0 }

[[rule.examples]]
kind = "negative"
numbers = { R = "1 GiB", T = "12 GiB", F = "8 GiB", A = 0, P = 0 }
'''
BAD_RULE = (  # line 8: the condition does not parse
    'engine_version = "1.0"\n\n[[rule]]\nid = "site.bad"\nversion = 1\nclass = "capacity"\npriority = 1\n'
    'condition = "R >>> T"\nremedy = "x"\n'
)
