"""Start the EAGLE chat web UI: ``python demo.py --base-model PATH --eagle-model PATH`` (both optional).

The same app as ``python -m eagle.application.webui``; every flag of that command works here (``--help``).
"""

from eagle.application.webui import main

if __name__ == "__main__":
    main(prog="python demo.py")
