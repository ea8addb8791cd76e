"""Package data for weights shipped with ortspec: a model recipe's trained EAGLE-3 draft head
(its "draft_head", a speculators checkpoint directory here with its recipe and data manifest),
which `ortspec export` adds to that model's exports (export/sources.py `shipped_head`). No
recipe names one yet, so none is shipped. The models directory's cache/ and exported/ are not
package data."""
