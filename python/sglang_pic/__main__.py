import sys

from sglang_pic.cli import main

sys.exit(main())
