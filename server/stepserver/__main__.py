"""`python -m server.stepserver`: the same as `enhancer step-server`."""
from .server import main

raise SystemExit(main())
