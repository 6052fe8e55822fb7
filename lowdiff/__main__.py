import sys

from lowdiff.cli.main import main

sys.exit(main())
