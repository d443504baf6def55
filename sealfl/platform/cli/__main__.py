"""``python -m sealfl.platform.cli``: the ``sealfl`` command."""

from sealfl.platform.cli import main

main()
