// Parses PromQL with the Prometheus project's own grammar (@prometheus-io/lezer-promql).
//
//   node tools/promql.mjs DIR < exprs.json
//
// DIR is where npm installed the grammar (`make test` puts it in .cache/promql); stdin is a
// JSON array of expressions; stdout a JSON array with, per expression,
//   {"ok": bool, "metrics": [names], "errors": [messages]}
// metrics: the names of its vector and range selectors (`foo` of `foo{a="b"}[5m]`; a
// selector naming its metric only by a __name__ matcher names none).
//
// The grammar accepts some expressions Prometheus refuses at query time, `rate(foo)` or
// `sum(foo[5m])`: the parser does not type arguments. The few type rules below catch
// those, the ones a dashboard most often gets wrong.

import { createRequire } from 'node:module';
import path from 'node:path';
import process from 'node:process';

const dir = process.argv[2];
if (!dir) {
  process.stderr.write('usage: node promql.mjs DIR < exprs.json\n');
  process.exit(2);
}
const require = createRequire(path.resolve(dir, 'package.json'));
const { parser } = require('@prometheus-io/lezer-promql');

// Functions whose argument at this index is a range vector (Prometheus' function table).
const RANGE_ARG = {
  rate: 0, irate: 0, increase: 0, delta: 0, idelta: 0, deriv: 0, changes: 0, resets: 0,
  predict_linear: 0, holt_winters: 0, double_exponential_smoothing: 0,
  quantile_over_time: 1,
};
const rangeArg = (fn) => (fn in RANGE_ARG ? RANGE_ARG[fn] : fn.endsWith('_over_time') ? 0 : -1);
const SCALAR_FNS = new Set(['scalar', 'time', 'pi']);

// Nodes that are expressions; the others are operators, modifiers and names.
const EXPRESSIONS = new Set(['NumberDurationLiteral', 'StringLiteral', 'VectorSelector',
  'MatrixSelector', 'SubqueryExpr', 'ParenExpr', 'OffsetExpr', 'AnchoredExpr', 'SmoothedExpr',
  'UnaryExpr', 'AggregateExpr', 'BinaryExpr', 'FunctionCall']);

function children(node, name) {
  const out = [];
  for (let c = node.firstChild; c; c = c.nextSibling) {
    if (name ? c.name === name : EXPRESSIONS.has(c.name)) out.push(c);
  }
  return out;
}

// The value type of an expression (scalar, vector, matrix or string); type errors met on
// the way go to `errors`.
function typeOf(node, text, errors) {
  const at = (n) => `${text.slice(n.from, n.to)} (at ${n.from})`;
  const args = (n) => {
    const [body] = children(n, 'FunctionCallBody');
    return body ? children(body).map((arg) => [arg, typeOf(arg, text, errors)]) : [];
  };
  switch (node.name) {
    case 'PromQL': {
      const [top] = children(node);
      return top ? typeOf(top, text, errors) : 'vector';
    }
    case 'NumberDurationLiteral':
      return 'scalar';
    case 'StringLiteral':
      return 'string';
    case 'MatrixSelector':
    case 'SubqueryExpr':
      return 'matrix';
    case 'ParenExpr':
    case 'OffsetExpr':
    case 'AnchoredExpr':
    case 'SmoothedExpr':
    case 'UnaryExpr':
      return typeOf(children(node)[0], text, errors);
    case 'AggregateExpr':
      for (const [arg, t] of args(node)) {
        if (t === 'matrix') errors.push(`an aggregation over a range vector: ${at(arg)}`);
      }
      return 'vector';
    case 'BinaryExpr': {
      const types = children(node).map((operand) => {
        const t = typeOf(operand, text, errors);
        if (t === 'matrix' || t === 'string') errors.push(`a ${t} operand: ${at(operand)}`);
        return t;
      });
      return types.every((t) => t === 'scalar') ? 'scalar' : 'vector';
    }
    case 'FunctionCall': {
      const [id] = children(node, 'FunctionIdentifier');
      const fn = id ? text.slice(id.from, id.to) : '';
      const want = rangeArg(fn);
      const typed = args(node);
      typed.forEach(([arg, t], i) => {
        if (i === want && t !== 'matrix') errors.push(`${fn}() needs a range vector, got a ${t}: ${at(arg)}`);
        if (i !== want && t === 'matrix') errors.push(`${fn}() takes no range vector there: ${at(arg)}`);
      });
      if (want >= typed.length) errors.push(`${fn}() needs a range vector argument: ${at(node)}`);
      return SCALAR_FNS.has(fn) ? 'scalar' : 'vector';
    }
    default:
      return 'vector';
  }
}

function check(expr) {
  const tree = parser.parse(expr);
  const errors = [];
  const metrics = new Set();
  tree.iterate({
    enter(node) {
      if (node.type.isError) {
        const near = node.from < expr.length ? JSON.stringify(expr.slice(node.from, node.from + 20)) : 'the end';
        errors.push(`syntax error at ${node.from}, near ${near}`);
      } else if (node.name === 'Identifier' && node.node.parent?.name === 'VectorSelector') {
        metrics.add(expr.slice(node.from, node.to));
      }
    },
  });
  if (!errors.length) typeOf(tree.topNode, expr, errors);
  if (!expr.trim()) errors.push('empty expression');
  return { ok: errors.length === 0, metrics: [...metrics].sort(), errors };
}

let input = '';
process.stdin.setEncoding('utf8');
for await (const chunk of process.stdin) input += chunk;
process.stdout.write(JSON.stringify(JSON.parse(input).map(check)));
