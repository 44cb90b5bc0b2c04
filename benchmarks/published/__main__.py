import sys

from benchmarks.published import main

sys.exit(main())
