"""`python -m exactrl.config` prints the Markdown reference; `--toml` prints the defaults as TOML."""

import sys

from exactrl.config import RunConfig, config_reference_markdown, dump_toml

if "--toml" in sys.argv[1:]:
    sys.stdout.write(dump_toml(RunConfig()))
else:
    sys.stdout.write(config_reference_markdown())
