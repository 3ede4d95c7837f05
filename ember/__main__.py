import sys

from ember.cli.main import main

sys.exit(main())
