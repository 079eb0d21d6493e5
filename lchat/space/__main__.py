import sys

from lchat.space import main

sys.exit(main())
