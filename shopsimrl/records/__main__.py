"""``python -m shopsimrl.records``: rewrite the checked-in JSON Schemas from the record models."""

from shopsimrl.records.jsonschema import write_schemas

for path in write_schemas():
    print(path)
