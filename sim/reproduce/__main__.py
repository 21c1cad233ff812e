import sys

from sim.reproduce import main

sys.exit(main())
