import sys

from labsim.cli import main

sys.exit(main())
