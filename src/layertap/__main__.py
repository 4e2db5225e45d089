"""``python -m layertap`` works like the ``layertap`` command (also under ``torchrun -m``)."""

from .cli import main

if __name__ == "__main__":
    main()
