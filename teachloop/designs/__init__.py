"""The designs of other libraries, rebuilt on teachloop to compare them: fastai v1 callbacks, Gluon handlers, event filters."""
